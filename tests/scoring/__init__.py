"""Tests of the read path's caches: the chain memo behind block keys, and what a request gets
through them (the same token ids and block keys as without)."""
