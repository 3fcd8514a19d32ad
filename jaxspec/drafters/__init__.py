"""Drafter kinds: what proposes the K-1 tokens a round verifies."""
