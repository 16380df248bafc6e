"""Speculative decoding: proposers, the policy that sizes their drafts, and the rules that verify them."""
