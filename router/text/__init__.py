"""Text handling of the request path: prompt bounds and tokenizing, chat templates, detokenizing, stop strings."""
