"""memfit where users already train: ``memfit.integrations.transformers`` (HF Trainer) and
``memfit.integrations.lightning`` (a PyTorch Lightning Strategy). Each imports its framework,
an optional dependency, only when imported itself."""
