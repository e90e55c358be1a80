"""The OpenAI routes' fixtures, a pytest plugin (conftest's `pytest_plugins`): `engine` (one async engine over
the tiny random Llama a test module), `app` (the routes over it), `http` (httpx over ASGI) and `oai` (the
official client over ASGI). A module may define its own `engine` or `app` instead (another size, other settings).

NOTE: the API's packages (starlette, openai, ...) are imported when a fixture is used, not here: the plugin loads
on every machine, the GPU machine's too, which has none of them.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(tiny_llama3_dir):
    from api_helpers import tiny_engine

    engine = tiny_engine(tiny_llama3_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    from api_helpers import mount

    return mount(lambda: engine)


@pytest.fixture
async def http(app):
    from api_helpers import http_client

    async with http_client(app) as client:
        yield client


@pytest.fixture
async def oai(app):
    from api_helpers import openai_client

    client = openai_client(app)
    yield client
    await client.close()
