"""vLLM's side: the version adapters (feature-detected), the configuration check in the caller's
process, and what a vLLM configuration asks of hscapture."""
