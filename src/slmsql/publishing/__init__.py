"""Publishing an adapter: the model card (`card`), the Hub push (`hub`), the MLflow Model Registry
(`registry`) and the text2sql pyfunc model (`text2sql`). Uses `generation` and everything below it.
"""
