"""Corpora, tokenizers, token shards and the batches of each step."""
