"""Chains of stages: the MLproject file rendered from the configs (`mlproject`) and the pipeline's and
sweep's steps run as MLflow child runs (`steps`). Uses `configs`, `tracking`.
"""
