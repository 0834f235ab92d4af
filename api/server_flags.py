"""The launcher's flags that vLLM's OpenAI server has under the same names: where to listen
(--uds, --root-path), CORS, request ids, request logging, the optional routes and LoRA
adapters (--lora-modules). launch.py
adds them to its parser and turns them into ServerSettings fields."""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat

from actors.config import runtime_lora_updating_allowed
from actors.config.cli_flags import parse_size_flag
from api.lora_models import LoRAModulePath
from api.response_store import DEFAULT_STORE_BYTES
from api.serving import DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE, DEFAULT_MAX_HEADER_COUNT
from api.tool_parsers import TOOL_PARSERS

# CORS: any origin, method and header, as vLLM's defaults
_ALLOW_ALL = ["*"]


def json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take: '["*"]' or '["https://a.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


def add_openai_server_flags(server: argparse._ArgumentGroup) -> None:
    """vLLM's server flags, in the parser's "HTTP server" group."""
    server.add_argument("--uds", metavar="PATH",
                        help="serve on this Unix domain socket instead of --host and --port")
    server.add_argument("--root-path", default="", metavar="PREFIX",
                        help="the path prefix a proxy in front of the server routes by (e.g. /llm): the proxy "
                             "strips it from requests, the server puts it back in URLs and logs")
    server.add_argument("--allowed-origins", type=json_list, default=_ALLOW_ALL, metavar="JSON",
                        help="CORS: the origins browsers may call from, as a JSON list (default: '[\"*\"]')")
    server.add_argument("--allowed-methods", type=json_list, default=_ALLOW_ALL, metavar="JSON",
                        help="CORS: the methods allowed, as a JSON list (default: '[\"*\"]')")
    server.add_argument("--allowed-headers", type=json_list, default=_ALLOW_ALL, metavar="JSON",
                        help="CORS: the request headers allowed, as a JSON list (default: '[\"*\"]')")
    server.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let browsers send cookies and Authorization headers cross-origin")
    server.add_argument("--enable-request-id-headers", action="store_true",
                        help="every response carries X-Request-Id: the request's own, or a new one")
    server.add_argument("--disable-log-requests", action="store_true",
                        help="no log line per request")
    server.add_argument("--enable-server-load-tracking", action="store_true",
                        help="count the generation requests in flight, served by GET /load")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's configuration, chat template included")
    server.add_argument("--allow-unauthenticated-metrics", action="store_true",
                        help="with --api-key, let GET /metrics answer without the key (for a Prometheus scraper "
                             "that sends none); /health and /ping always do")
    server.add_argument("--h11-max-incomplete-event-size", type=int, default=DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
                        metavar="BYTES", help="the most bytes of request line and headers; past them, 431 or 400 "
                                              "(default: %(default)s)")
    server.add_argument("--h11-max-header-count", type=int, default=DEFAULT_MAX_HEADER_COUNT, metavar="N",
                        help="requests with more headers get 431 (default: %(default)s)")


def add_openai_api_flags(api: argparse._ArgumentGroup) -> None:
    """vLLM's flags for what the API answers: chat template, roles, logprobs, usage
    (--max-logprobs is an engine flag: EngineArgs.max_logprobs)."""
    api.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                     help="a Jinja chat template (a file, or the template itself) for chat requests that send "
                          "none; default: the tokenizer's")
    api.add_argument("--trust-request-chat-template", action="store_true",
                     help="render a request's own chat_template (Jinja code the server runs, within "
                          "--chat-template-timeout); without it such a request gets 400")
    api.add_argument("--response-role", default="assistant", metavar="ROLE",
                     help="the role of generated chat messages (default: %(default)s)")
    api.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help="logprobs name tokens as 'token_id:<id>' unless a request says otherwise")
    api.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="usage.prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache")
    api.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="serve tool_choice 'auto' (the default with tools): calls read from the output by "
                          "--tool-call-parser")
    api.add_argument("--tool-call-parser", metavar="NAME",
                     help=f"how the model writes tool calls: {', '.join(TOOL_PARSERS)}")
    api.add_argument("--responses-store-size", type=parse_size_flag, default=DEFAULT_STORE_BYTES, metavar="SIZE",
                     help="memory for the /v1/responses kept for previous_response_id, measured as their JSON; "
                          "the least recently used are forgotten past it (default: 64MiB)")
    api.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                     help="with tool_choice 'none', leave the tools out of the prompt")


def parse_lora_module(text: str) -> LoRAModulePath:
    """One --lora-modules item in vLLM's forms: name=path, or a JSON object
    {"name": ..., "path": ..., "base_model_name": ...} (base_model_name optional)."""
    if "=" in text and "," not in text and not text.lstrip().startswith("{"):
        name, _, path = text.partition("=")
        if not name or not path:
            raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
        return LoRAModulePath(name, path)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        fields = None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object with name and path, got {text!r}")
    unknown = set(fields) - {"name", "path", "base_model_name"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown field(s) {', '.join(sorted(unknown))} in {text!r}; "
                                         "a module has name, path and base_model_name")
    if not all(isinstance(fields.get(key), str) and fields[key] for key in ("name", "path")):
        raise argparse.ArgumentTypeError(f"a module needs a non-empty name and path, got {text!r}")
    base_model_name = fields.get("base_model_name")
    if base_model_name is not None and not isinstance(base_model_name, str):
        raise argparse.ArgumentTypeError(f"base_model_name must be a string, got {text!r}")
    return LoRAModulePath(fields["name"], fields["path"], base_model_name)


def add_lora_server_flags(lora: argparse._ArgumentGroup) -> None:
    """vLLM's server flags for LoRA adapters, in the engine's "LoRA adapters" group."""
    lora.add_argument("--lora-modules", type=parse_lora_module, nargs="+", default=[], metavar="MODULE",
                      help="adapters served from the start, each under its own model name: name=path, or JSON "
                           "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (needs --enable-lora)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; needs --enable-lora)")


def load_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the value itself when it is a template
    (vLLM's rule: text with braces or a line break is a template, else a path)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if any(char in value for char in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def check_openai_server_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits with a usage error (status 2) for a value the server could not use; reads
    the --chat-template file."""
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except (ValueError, OSError) as error:
            parser.error(str(error))
    root_path = args.root_path
    if root_path and (not root_path.startswith("/") or root_path.endswith("/")):
        parser.error(f"--root-path must start with '/' and not end with one (e.g. /llm), got {root_path!r}")
    for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.uds is not None and not args.uds:
        parser.error("--uds needs a socket path")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        parser.error(f"--tool-call-parser: unknown parser {args.tool_call_parser!r}; choose one of "
                     f"{', '.join(TOOL_PARSERS)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    _check_lora_flags(parser, args)


def _check_lora_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("lora_modules", "allow_runtime_lora_updating"):
        if getattr(args, flag) and not args.enable_lora:
            parser.error(f"--{flag.replace('_', '-')} needs --enable-lora")
    names = [module.name for module in args.lora_modules]
    served = args.served_model_name or [args.model]
    for name in names:
        if names.count(name) > 1:
            parser.error(f"--lora-modules: the name {name!r} is given twice")
        if name in served:
            parser.error(f"--lora-modules: {name!r} is a served name of the base model; an adapter needs another")


def openai_server_settings(args: argparse.Namespace) -> dict:
    """The ServerSettings fields these flags set."""
    return dict(log_requests=not args.disable_log_requests, root_path=args.root_path,
                allow_unauthenticated_metrics=args.allow_unauthenticated_metrics,
                max_header_count=args.h11_max_header_count, max_header_bytes=args.h11_max_incomplete_event_size,
                enable_request_id_headers=args.enable_request_id_headers,
                enable_server_load_tracking=args.enable_server_load_tracking,
                enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                chat_template=args.chat_template, response_role=args.response_role,
                trust_request_chat_template=args.trust_request_chat_template,
                responses_store_bytes=args.responses_store_size,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                allow_runtime_lora_updating=args.allow_runtime_lora_updating or runtime_lora_updating_allowed())


def bind_unix_socket(path: str) -> socket.socket:
    """A stream socket bound to path. A socket file left by a server that died is replaced;
    one a live server listens on, or any other file, is an error (OSError)."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket")
        if _in_use(path):
            raise OSError(f"another server listens on {path}")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    return sock


def _in_use(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True
