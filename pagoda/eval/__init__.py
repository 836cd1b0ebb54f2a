"""Quality evaluation with the engine itself (perplexity)."""
