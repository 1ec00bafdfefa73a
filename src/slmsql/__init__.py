"""slmsql: an MLflow-tracked lifecycle for reinforcement learning of small Text-to-SQL models."""

__version__ = "0.1.0"
