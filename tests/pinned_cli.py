"""Test helper: `python tests/pinned_cli.py PINS.json <stage> <args>` runs the slmsql CLI in this process with some
questions' samples pinned (`scripted.pin`: PINS.json holds {"completions": {id: [K texts]}, "answers": {id: text}}),
the model generating the rest: an outcome a test needs (a band question for the filter) constructed in a stage
run as a user runs it, in a new process, instead of hoped for from a model's floats on this machine."""

import json
import sys
from pathlib import Path

import pytest
import scripted

from slmsql.cli import main

if __name__ == "__main__":
    pins = json.loads(Path(sys.argv[1]).read_text())
    scripted.pin(pytest.MonkeyPatch(), completions=pins.get("completions"), answers=pins.get("answers"))
    sys.argv = ["slmsql", *sys.argv[2:]]
    main()
