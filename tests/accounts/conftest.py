import pytest


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Passwords here are test data: a fast hasher keeps each test fast (the real one is PBKDF2)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
