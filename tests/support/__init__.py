"""Helpers shared by the tests (seeds, reference models, subprocess runners, fakes). Test modules import
these, never each other."""
