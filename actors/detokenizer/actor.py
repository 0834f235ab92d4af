"""The detokenizer actor: receives TrackRequest, StepOutputs and AbortRequest from the
scheduler and sends RequestOutputs to the frontend and FinishRequest to the scheduler,
around the plain OutputProcessor (output_processor.py)."""

from __future__ import annotations

from actors.detokenizer.output_processor import OutputProcessor
from actors.runtime.actor import Actor, ActorSpec
from messages.detokenizer import DetokenizerInbox, StepOutputs, TrackRequest
from messages.frontend import RequestOutputs
from messages.scheduler import AbortRequest, FinishRequest
from messages.transport import Sockets


class DetokenizerActor(Actor):
    """Receives TrackRequest, StepOutputs and AbortRequest from the scheduler; sends
    RequestOutputs deltas to the frontend and FinishRequest to the scheduler when a stop
    string matches. Owns one decode stream per live completion."""

    inbox_type = DetokenizerInbox

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets, processor: OutputProcessor) -> None:
        super().__init__(name, addresses, sockets)
        self.to_scheduler = sockets.outbox(addresses["scheduler"])
        self.processor = processor

    @classmethod
    def from_spec(cls, spec: ActorSpec, sockets: Sockets) -> DetokenizerActor:
        from actors.models.loader import load_backend_tokenizer

        backend = load_backend_tokenizer(spec.engine.tokenizer_path)
        return cls(spec.name, spec.addresses, sockets, OutputProcessor(backend))

    def handle(self, message) -> None:
        match message:
            case StepOutputs():
                deltas, stops = self.processor.process(message)
                for stop in stops:
                    self.to_scheduler.send(FinishRequest(stop.request_id, stop.index, stop.stop))
                if deltas:
                    self.to_frontend.send(RequestOutputs(deltas))
            case TrackRequest():
                self.processor.add_request(message.request_id, None, message.prompt_token_ids, message.params)
            case AbortRequest(request_id=request_id):
                self.processor.abort_request(request_id)  # the frontend has stopped listening
