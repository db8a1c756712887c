"""Structured outputs: a request's grammar (JSON schema, regex, choice, EBNF grammar), compiled
once and cached, and the per-request matcher that masks the verifier's logits, checks drafts
and advances by the accepted tokens."""
