from cli_tests.fakeportal import portal  # noqa: F401 (a fixture)
