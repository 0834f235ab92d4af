from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> str:
    from tests.multimodal.tiny_llava import build_tiny_llava

    return build_tiny_llava(str(tmp_path_factory.mktemp("tiny-llava")))
