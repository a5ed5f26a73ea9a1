"""The floor of an ext_proc exchange in Python (``bench/envoy_front.py``'s ``EnvoyFloor``): a
picker that names one endpoint without looking at the request, over grpc.aio's read/write API as
``epp.server`` does, so that Envoy + the picker's added latency splits into Envoy's hop, the
exchange and the choice.

    python bench/fixed_picker.py PORT IP:PORT
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
from google.protobuf import struct_pb2


def named(endpoint: str) -> pb.ProcessingResponse:
    header = base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=endpoint.encode())
    mutation = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(header=header)])
    metadata = struct_pb2.Struct()
    metadata.update({"envoy.lb": {"x-gateway-destination-endpoint": endpoint}})
    common = pb.CommonResponse(clear_route_cache=True, header_mutation=mutation)
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
    )


class Fixed(pbg.ExternalProcessorServicer):
    def __init__(self, endpoint: str) -> None:
        self.answer = named(endpoint)

    async def Process(self, requests, context) -> None:  # the gRPC method's name
        body = []
        while (message := await context.read()) is not grpc.aio.EOF:
            kind = message.WhichOneof("request")
            if kind == "request_headers" and message.request_headers.end_of_stream:
                await context.write(self.answer)
            elif kind == "request_body":
                body.append(message.request_body.body)
                if message.request_body.end_of_stream:
                    await context.write(self.answer)
                    streamed = pb.StreamedBodyResponse(body=b"".join(body), end_of_stream=True)
                    mutation = pb.BodyMutation(streamed_response=streamed)
                    body_answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
                    await context.write(pb.ProcessingResponse(request_body=body_answer))
            elif kind == "response_headers":
                await context.write(pb.ProcessingResponse(response_headers=pb.HeadersResponse()))
            elif kind == "request_trailers":
                await context.write(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))


async def main(port: int, endpoint: str) -> None:
    server = grpc.aio.server()
    pbg.add_ExternalProcessorServicer_to_server(Fixed(endpoint), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
