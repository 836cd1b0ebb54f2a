"""Prometheus metrics: the server's families and the engine's, per replica, LoRA, structured output, disaggregation."""
