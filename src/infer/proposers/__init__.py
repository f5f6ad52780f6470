"""Proposers: whatever guesses a request's next tokens for the speculative round (spec_decode.round).

suffix.py: suffix decoding, a suffix tree (suffix_tree.cpp) over this engine's earlier and running requests.
"""
