"""Exceptions raised by netns_testbed, with messages a user can act on."""


class TestbedError(RuntimeError):
    """Building, changing or removing a testbed failed."""

    __test__ = False  # not a pytest test class despite the name


class NotRootError(TestbedError):
    """The caller lacks the privileges to create network namespaces."""

    def __init__(
        self, msg: str = "not root: run with sudo (network namespaces need CAP_SYS_ADMIN)"
    ):
        super().__init__(msg)
