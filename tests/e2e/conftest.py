import pytest

from tests.e2e.stack import Stack


@pytest.fixture
def make_stack(tmp_path):
    stacks = []

    def make(**kwargs) -> Stack:
        stack = Stack(tmp_path, **kwargs)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:  # always, even when the test failed
        stack.close()
