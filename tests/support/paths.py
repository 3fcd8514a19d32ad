"""Where things are: the checkout (REPO) and this folder (TESTS), for tests at any depth under tests/."""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
FIXTURES = os.path.join(TESTS, "fixtures")
