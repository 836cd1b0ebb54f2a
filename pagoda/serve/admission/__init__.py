"""What is let in: tenants and their limits, request bounds, the admission queue and latency targets."""
