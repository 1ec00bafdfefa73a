"""The loopback Hub stand-in, exercised with the real huggingface_hub client."""

import http.client
import json

import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError

from hubstub import HubStub

REPO = "stub-user/sql-adapter"
README = b"---\nlicense: apache-2.0\nbase_model: tiny-qwen2\ntags:\n- text-to-sql\n---\n\n# SQL adapter\n"


@pytest.fixture
def hub(monkeypatch):
    with HubStub(lfs_threshold=1024) as stub:
        stub.configure_client(monkeypatch)
        yield stub


@pytest.fixture
def adapter_dir(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "README.md").write_bytes(README)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 20)  # 5,120 bytes: LFS
    return folder


def local_files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_create_repo_exist_ok_and_conflict(hub):
    api = HfApi(endpoint=hub.url, token=hub.token)
    first = api.create_repo(REPO, private=True, exist_ok=True)
    second = api.create_repo(REPO, private=True, exist_ok=True)
    assert first == second == f"{hub.url}/{REPO}"
    assert list(hub.repos) == [REPO] and hub.repos[REPO]["private"] is True
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo(REPO)
    assert err.value.response.status_code == 409
    assert len(hub.repos) == 1 and hub.unhandled == []


def test_upload_folder_regular_and_lfs(hub, adapter_dir, tmp_path):
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(REPO, exist_ok=True)
    info = api.upload_folder(folder_path=adapter_dir, repo_id=REPO, commit_message="Add GRPO adapter")

    commits = hub.repos[REPO]["commits"]
    assert len(commits) == 1 and commits[0]["message"] == "Add GRPO adapter"
    assert info.oid == commits[0]["oid"] and hub.files(REPO) == local_files(adapter_dir)
    assert api.model_info(REPO).sha == info.oid

    # The big file went through the LFS batch + PUT, the small ones inline in the commit.
    puts = [r for r in hub.requests if r["method"] == "PUT"]
    assert [p["body"] for p in puts] == [(adapter_dir / "adapter_model.safetensors").read_bytes()]
    commit_req = next(r for r in hub.requests if r["path"].endswith("/commit/main"))
    keys = {json.loads(line)["value"].get("path"): json.loads(line)["key"] for line in commit_req["body"].splitlines()}
    assert keys == {None: "header", "README.md": "file", "adapter_config.json": "file",
                    "adapter_model.safetensors": "lfsFile"}

    readme = hf_hub_download(REPO, "README.md", endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "cache")
    assert open(readme, "rb").read() == README
    assert sorted(api.list_repo_files(REPO)) == sorted(local_files(adapter_dir))
    assert hub.unhandled == []


def test_unchanged_upload_makes_no_commit(hub, adapter_dir):
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(REPO)
    first = api.upload_folder(folder_path=adapter_dir, repo_id=REPO, commit_message="v1")
    again = api.upload_folder(folder_path=adapter_dir, repo_id=REPO, commit_message="v1 again")
    assert again.oid == first.oid and len(hub.repos[REPO]["commits"]) == 1
    assert sum(r["method"] == "PUT" for r in hub.requests) == 1  # the LFS object is not sent twice


def test_invalid_front_matter_is_refused_before_upload(hub, adapter_dir):
    (adapter_dir / "README.md").write_text("---\nlicense: [apache\n---\n# card\n")
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(REPO)
    with pytest.raises(ValueError, match="Invalid metadata in README.md"):
        api.upload_folder(folder_path=adapter_dir, repo_id=REPO, commit_message="bad card")
    assert hub.repos[REPO]["commits"] == [] and not any(r["method"] == "PUT" for r in hub.requests)


def test_wrong_token_is_refused_and_creates_nothing(hub, adapter_dir):
    api = HfApi(endpoint=hub.url, token="hf_" + "0" * 32)
    for call in (lambda: api.create_repo(REPO), lambda: api.create_repo(REPO, exist_ok=True),
                 lambda: api.upload_folder(folder_path=adapter_dir, repo_id=REPO, commit_message="x")):
        with pytest.raises(HfHubHTTPError) as err:
            call()
        assert err.value.response.status_code == 401
    assert hub.repos == {}


def test_private_repo_needs_the_token_to_read(hub, adapter_dir, tmp_path):
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(REPO, private=True)
    api.upload_folder(folder_path=adapter_dir, repo_id=REPO, commit_message="private")
    with pytest.raises(HfHubHTTPError) as err:
        HfApi(endpoint=hub.url, token=False).model_info(REPO)
    assert err.value.response.status_code == 401


def test_token_travels_only_in_the_authorization_header(hub, adapter_dir, tmp_path):
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(REPO)
    api.upload_folder(folder_path=adapter_dir, repo_id=REPO, commit_message="Add adapter")
    hf_hub_download(REPO, "adapter_config.json", endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "cache")

    token = hub.token.encode()
    assert len(hub.requests) >= 6
    for r in hub.requests:
        assert token not in (r["path"] + "?" + r["query"]).encode() and token not in r["body"]
        other_headers = {k: v for k, v in r["headers"].items() if k != "authorization"}
        assert hub.token not in json.dumps(other_headers)
    authed = [r for r in hub.requests if r["headers"].get("authorization") == f"Bearer {hub.token}"]
    assert {r["path"] for r in authed} >= {"/api/repos/create", f"/api/models/{REPO}/commit/main"}


def test_chunked_bodies_and_unknown_paths(hub):
    conn = http.client.HTTPConnection(hub.url.removeprefix("http://"))
    chunks = [b'{"content": "---\\nlicense: [mit\\n---\\n",', b' "repoType": "model"}']
    conn.request("POST", "/api/validate-yaml", body=iter(chunks), encode_chunked=True,
                 headers={"Authorization": f"Bearer {hub.token}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "Invalid YAML" in json.loads(resp.read())["errors"][0]["message"]
    assert hub.requests[-1]["body"] == b"".join(chunks)
    conn.request("GET", "/api/spaces/x/y")  # same keep-alive connection: the chunked body was fully consumed
    resp = conn.getresponse()
    assert resp.status == 404 and json.loads(resp.read())["error"]
    assert hub.unhandled == ["GET /api/spaces/x/y"]
