"""MkDocs hook: the pages generated from the code. `docs/cli.md` and `docs/vocabulary.md` hold a marker that
is replaced, at build time, by the CLI reference (`slmsql.cli.reference_markdown`, from configs.py) and the
metric table (`slmsql.tracking.vocabulary.vocabulary_markdown`), so the docs cannot drift from what the code accepts
and logs. A marker missing from its page fails the build."""

GENERATED = {
    "cli.md": ("<!-- slmsql:cli -->", lambda: __import__("slmsql.cli", fromlist=["x"]).reference_markdown()),
    "vocabulary.md": ("<!-- slmsql:vocabulary -->",
                      lambda: __import__("slmsql.tracking.vocabulary", fromlist=["x"]).vocabulary_markdown()),
}


def render(src_uri: str, markdown: str) -> str:
    if src_uri not in GENERATED:
        return markdown
    marker, make = GENERATED[src_uri]
    if marker not in markdown:
        raise ValueError(f"docs/{src_uri}: the marker {marker} is missing (docs/hooks.py fills it in)")
    return markdown.replace(marker, make())


def on_page_markdown(markdown, page, config, files):
    return render(page.file.src_uri, markdown)
