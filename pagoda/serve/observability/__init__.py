"""What the server records about the requests it answers: the request log, the prompt log, the
access log's redaction, traces, provenance, cost, and the drift rules between two servings."""
