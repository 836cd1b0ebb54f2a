"""Which model answers a request: routes (rules on tenant, task, prompt length and class),
then the model's fallbacks, local or remote, when it cannot."""
