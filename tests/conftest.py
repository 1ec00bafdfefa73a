import sqlite3

import pytest


@pytest.fixture
def shop(tmp_path):
    """A tiny database at <root>/shop/shop.sqlite; returns the db root."""
    root = tmp_path / "dbs"
    (root / "shop").mkdir(parents=True)
    con = sqlite3.connect(root / "shop" / "shop.sqlite")
    con.executescript("""
        CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price REAL, kind TEXT);
        INSERT INTO item VALUES (1, 'pen', 1.5, 'office'), (2, 'cup', 4.0, 'kitchen'),
                                (3, 'pad', 2.25, 'office'), (4, 'pot', 9.0, 'kitchen');
    """)
    con.commit()
    con.close()
    return root


@pytest.fixture(autouse=True)
def _isolated_mlflow(tmp_path, monkeypatch):
    """Each test tracks into its own SQLite store, never the developer's mlflow.db."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    import mlflow  # set_tracking_uri is process-wide: undo whatever an earlier test's stage set

    mlflow.set_tracking_uri(uri)
    yield
    while mlflow.active_run():
        mlflow.end_run()
