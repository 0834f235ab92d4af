from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> str:
    from tests.multimodal.tiny_llava import build_tiny_llava

    return build_tiny_llava(str(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="session")
def tiny_qwen2vl_dir(tmp_path_factory) -> str:
    from tests.multimodal.tiny_qwen2vl import build_tiny_qwen2vl

    return build_tiny_qwen2vl(str(tmp_path_factory.mktemp("tiny-qwen2vl")))


@pytest.fixture(scope="session")
def tiny_qwen25vl_dir(tmp_path_factory) -> str:
    from tests.multimodal.tiny_qwen2vl import build_tiny_qwen2vl

    return build_tiny_qwen2vl(str(tmp_path_factory.mktemp("tiny-qwen25vl")), qwen2_5=True)
