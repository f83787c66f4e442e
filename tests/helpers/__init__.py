"""What more than one test file uses, in one place: test files import from here (``from helpers.heads
import ...``) and never from each other; fixtures and the tier table live in tests/conftest.py."""
