from unmapped import medium  # noqa: F401  (the unmapped:// medium, a fixture for every test here)
