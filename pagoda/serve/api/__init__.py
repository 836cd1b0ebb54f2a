"""The HTTP API: endpoints, the request and response shapes they speak, and the generation skeleton they share."""
