"""slmsql: an MLflow-tracked lifecycle for reinforcement learning of small Text-to-SQL models."""

__version__ = "0.1.0"

# The library's packages from the bottom up: a module may import its own package and those before it, never one
# after it (tests/test_layers.py; docs/development.md draws the map). `errors` and `configs` are modules.
LAYERS = ("errors", "configs", "inputs", "stats", "runtime", "sql", "checks", "rewards", "tracking", "policy",
          "generation", "training", "toy", "publishing", "workflow", "studies", "suites", "stages", "cli")
