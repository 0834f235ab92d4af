"""python -m actors.launch: the OpenAI-compatible HTTP server over a troupe engine.

    python -m actors.launch                      # the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000
    python -m actors.launch --model PATH --port 8080 --api-key secret

A thin entry point: the server's assembly (its flags, the engine it starts, uvicorn, the
shutdown) is api/server.py, so that api/ imports actors/ and never the other way but here,
at the top of the tree."""

from api.server import Launcher, build_parser, engine_args, main, parse_args

__all__ = ["Launcher", "build_parser", "engine_args", "main", "parse_args"]

if __name__ == "__main__":
    main()
