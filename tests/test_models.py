"""Model loading, the tiny offline Qwen2, adapters and batched generation (CPU, a few seconds)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from neartie import DrawMargins, assert_greedy_same_but_near_ties, assert_samples_same_but_near_ties
from transformers import AutoModelForCausalLM, AutoTokenizer

from slmsql.errors import SlmsqlError
from slmsql.policy.models import check_adapter_base, load_model
from slmsql.toy.tiny_model import build_tiny_model, train_bpe
from slmsql.generation.sampling import generate

TEXTS = [
    "CREATE TABLE singer (singer_id INTEGER, name TEXT, age INTEGER, country TEXT)",
    "How many singers are older than 30?",
    "SELECT count(*) FROM singer WHERE age > 30",
    "List the names of singers from France born in 1984.",
    "SELECT name FROM singer WHERE country = 'France' AND birth_year = 1984",
    "What is the average age of all singers?",
    "SELECT avg(age) FROM singer",
    "Years 1984, 1985, 1986, 2024 and 2025 had 1984 1985 2024 hits.",  # digits would merge without Qwen's split
] * 4
TINY = dict(vocab_size=300, hidden=32, layers=1, heads=4, ffn=64)
SAMPLES = [
    "SELECT name FROM singer WHERE age > 2024",
    "Café naïve: 'quoted' text\n\twith 12345 digits and ünïcödé",
    "ﬁle x² ½",  # NFKC (not Qwen's NFC) would rewrite these
    "<|im_start|>user\nHow many singers?<|im_end|>\n<|im_start|>assistant\n",
]
PROMPTS = ["SELECT name", "How many singers are older than 30? Answer in SQL please.", "CREATE TABLE", "What"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TEXTS, **TINY)


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(tiny, device="cpu")


def test_reload_gives_the_trained_ids_with_digits_split(tiny):
    trained = train_bpe(TEXTS, TINY["vocab_size"])
    reloaded = AutoTokenizer.from_pretrained(tiny)
    for text in SAMPLES:
        assert reloaded(text)["input_ids"] == trained.encode(text).ids
        assert reloaded.decode(reloaded(text)["input_ids"]) == text
    tokens = reloaded.convert_ids_to_tokens(reloaded("born in 1984")["input_ids"])
    assert tokens[-4:] == ["1", "9", "8", "4"]
    assert "SELECT" in reloaded.convert_ids_to_tokens(reloaded("SELECT name")["input_ids"])  # merges survived


def test_build_is_deterministic(tiny, tmp_path):
    again = build_tiny_model(tmp_path / "again", TEXTS, **TINY)
    assert (again / "tokenizer.json").read_text() == (tiny / "tokenizer.json").read_text()
    a, b = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (tiny, again))
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = build_tiny_model(tmp_path / "other", TEXTS, **TINY, seed=1)
    c = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_chat_template_renders_chatml(loaded):
    _, tok = loaded
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q 12"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ 12<|im_end|>\n<|im_start|>assistant\n"
    plain = tok.apply_chat_template(msgs, tokenize=False)
    assert not plain.endswith("assistant\n")
    ids = tok(text)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok.eos_token == "<|im_end|>"


def test_load_model_cpu_fp32(loaded):
    model, tok = loaded
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>"
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    logits = model(**tok(["SELECT name"], return_tensors="pt")).logits
    assert logits.shape[-1] == len(tok)


def test_load_model_without_chat_template_fails(tiny, tmp_path):
    copy = shutil.copytree(tiny, tmp_path / "notemplate")
    (copy / "chat_template.jinja").unlink()
    with pytest.raises(SlmsqlError, match="chat template"):
        load_model(copy, device="cpu")


def test_unknown_model_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SlmsqlError, match="no-such-model"):
        load_model(missing, device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SlmsqlError, match="empty"):
        load_model(tmp_path / "empty", device="cpu")


@pytest.fixture(scope="module")
def adapter(tiny, loaded, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    base, _ = load_model(tiny, device="cpu", trainable=True)
    torch.manual_seed(0)
    # init_lora_weights=False: random B, so the adapter really changes the outputs (default B = 0 does not).
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(base, config).eval()
    path = tmp_path_factory.mktemp("a") / "adapter"
    peft_model.save_pretrained(path)
    ids = loaded[1](PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = peft_model(**ids).logits
    return path, ids, expected


def test_adapter_reloads_to_the_adapted_model(tiny, loaded, adapter):
    path, ids, expected = adapter
    model, _ = load_model(tiny, path, device="cpu")
    with torch.no_grad():
        got = model(**ids).logits
        base = loaded[0](**ids).logits
    assert torch.equal(got, expected)
    assert not torch.allclose(base, expected, atol=1e-3)  # the check above would catch a silently dropped adapter
    out = generate(model, loaded[1], PROMPTS, max_new_tokens=4, progress=False)  # a PeftModel generates too
    assert out != generate(loaded[0], loaded[1], PROMPTS, max_new_tokens=4, progress=False)
    merged, _ = load_model(tiny, path, device="cpu", merge_adapter=True)
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        assert torch.allclose(merged(**ids).logits, expected, atol=1e-5)


def test_adapter_for_another_base_fails_before_loading(tiny, adapter, tmp_path, monkeypatch):
    other = shutil.copytree(tiny, tmp_path / "other-base")

    def no_loading(*a, **k):
        raise AssertionError("weights were loaded before the adapter check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(SlmsqlError, match="trained on base model"):
        load_model(other, adapter[0], device="cpu")
    check_adapter_base(adapter[0], tiny)  # the right base passes


def _adapter_dir(tmp_path, base):
    path = tmp_path / "ad"
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    return path


def test_adapter_base_rule_hub_id_vs_local_copy(tmp_path):
    local = tmp_path / "models" / "Qwen2.5-Coder-1.5B-Instruct"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    check_adapter_base(_adapter_dir(tmp_path, "Qwen/Qwen2.5-Coder-1.5B-Instruct"), local)
    check_adapter_base(_adapter_dir(tmp_path, "Qwen/Qwen2.5-Coder-1.5B-Instruct"), "qwen/qwen2.5-coder-1.5b-instruct/")
    with pytest.raises(SlmsqlError, match="Qwen2.5-Coder-1.5B-Instruct"):
        check_adapter_base(_adapter_dir(tmp_path, "Qwen/Qwen2.5-Coder-1.5B-Instruct"), "Qwen/Qwen2.5-Coder-0.5B")
    with pytest.raises(SlmsqlError):
        check_adapter_base(_adapter_dir(tmp_path, "Qwen/Qwen2.5-Coder-1.5B"), "Qwen/Qwen2.5-Coder-1.5B-Instruct")


def test_missing_adapter_fails(tiny, tmp_path):
    with pytest.raises(SlmsqlError, match="not found"):
        load_model(tiny, tmp_path / "no-adapter", device="cpu")
    (tmp_path / "plain").mkdir()
    with pytest.raises(SlmsqlError, match="adapter_config.json"):
        check_adapter_base(tmp_path / "plain", tiny)


def test_greedy_is_deterministic_and_batching_does_not_change_it(loaded):
    model, tok = loaded
    batched = generate(model, tok, PROMPTS, max_new_tokens=10, batch_size=4, progress=False)
    assert batched == generate(model, tok, PROMPTS, max_new_tokens=10, batch_size=4, progress=False)
    one_by_one = [generate(model, tok, [p], max_new_tokens=10, batch_size=1, progress=False)[0] for p in PROMPTS]
    # batch 4 and batch 1 are two float paths (padding, matmul shapes): the same answers but at a near-tie
    assert_greedy_same_but_near_ties(model, tok, PROMPTS, batched, one_by_one, 10)
    assert all(len(x) == 1 and x[0] for x in batched)
    twice = generate(model, tok, PROMPTS, num_return_sequences=2, max_new_tokens=10, progress=False)
    assert twice == [x * 2 for x in batched]


def test_sampling_k_per_prompt_in_order_and_seeded(loaded):
    model, tok = loaded
    kw = dict(num_return_sequences=3, temperature=1.0, max_new_tokens=8, batch_size=2, progress=False)
    first = generate(model, tok, PROMPTS, seed=7, **kw)
    assert [len(x) for x in first] == [3] * len(PROMPTS)
    assert first == generate(model, tok, PROMPTS, seed=7, **kw)
    assert first != generate(model, tok, PROMPTS, seed=8, **kw)
    # Batches are formed by length, not by input order, so reversing the input must reverse the output.
    assert generate(model, tok, PROMPTS[::-1], seed=7, **kw) == first[::-1]


def test_a_sample_depends_on_its_key_not_its_batch(loaded, monkeypatch):
    """Engine independence: prompt j's samples are the same alone, in any batch size, among other prompts (but
    where a draw fell at a near-tie: other batches are other float paths), and under another key they differ (so
    keys, not positions, decide)."""
    model, tok = loaded
    kw = dict(num_return_sequences=3, temperature=1.0, max_new_tokens=8, seed=5, progress=False)
    keys = ["q1", "q2", "q3", "q4"]
    draws = DrawMargins(monkeypatch)
    whole = generate(model, tok, PROMPTS, batch_size=4, keys=keys, **kw)
    assert_samples_same_but_near_ties(draws, 5, keys, whole, generate(model, tok, PROMPTS, batch_size=1, keys=keys,
                                                                      **kw))
    assert_samples_same_but_near_ties(draws, 5, keys[2:], whole[2:],
                                      generate(model, tok, PROMPTS[2:], batch_size=3, keys=keys[2:], **kw))
    assert_samples_same_but_near_ties(draws, 5, ["q2"], [whole[1]], generate(model, tok, [PROMPTS[1]], keys=["q2"],
                                                                             **kw))
    assert [whole[1]] != generate(model, tok, [PROMPTS[1]], keys=["q9"], **kw)
    assert len(set(map(tuple, whole))) > 1 and any(len(set(x)) > 1 for x in whole)  # it does sample


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", [
    (1.0, 1.0, 0, 0.0), (0.5, 1.0, 0, 0.0), (1.0, 0.7, 0, 0.0),
    (1.0, 0.8, 3, 0.0),  # top-k drops 2 tokens, then top-p a third
    (1.0, 1.0, 0, 0.2),  # min-p drops the 2 tokens under 0.2 x the top probability
])
def test_row_sampler_draws_from_the_warped_distribution(temperature, top_p, top_k, min_p):
    """Each row's token follows softmax(logits / T) restricted to the top-k, then to the top-p nucleus, then
    to min-p (transformers' order): a chi-square test of 4,000 rows (each its own seed) against the
    probabilities computed here by hand."""
    from scipy.stats import chisquare

    from slmsql.generation.sampling import _RowSampler
    from slmsql.runtime.seeds import sample_seed

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])  # sorted descending: the filters below rely on it
    p = torch.softmax(logits / temperature, dim=0)
    keep = torch.arange(5) < (top_k or 5)
    p = torch.where(keep, p, 0.0) / torch.where(keep, p, 0.0).sum()
    keep &= torch.cumsum(p, 0) - p < top_p  # the smallest set holding top_p
    p = torch.where(keep, p, 0.0) / torch.where(keep, p, 0.0).sum()
    keep &= p >= min_p * p.max()
    p = torch.where(keep, p, 0.0)
    assert 1 < keep.sum() < 5 or (top_k, top_p, min_p) == (0, 1.0, 0.0)  # each case filters, yet samples
    n = 4000
    sampler = _RowSampler([sample_seed(0, "k", i) for i in range(n)], temperature, top_p, top_k, min_p)
    out = sampler(None, logits.repeat(n, 1))
    assert ((out == 0).sum(dim=1) == 1).all() and torch.isinf(out).sum() == n * 4  # one finite score per row
    counts = torch.bincount(out.argmax(dim=1), minlength=5)
    assert (counts[~keep] == 0).all()
    expected = n * p[keep].double().numpy() / p[keep].double().sum().item()
    assert chisquare(counts[keep].numpy(), expected).pvalue > 1e-3


def test_bad_generation_arguments(loaded):
    model, tok = loaded
    with pytest.raises(SlmsqlError, match="backend"):
        generate(model, tok, PROMPTS, backend="nope")
    with pytest.raises(SlmsqlError, match="top_p"):
        generate(model, tok, PROMPTS, top_p=0)
    assert generate(model, tok, [], progress=False) == []
