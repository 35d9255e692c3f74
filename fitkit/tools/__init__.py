"""One-off tools around a model: the LR finder, the layer summary, the export for serving."""
