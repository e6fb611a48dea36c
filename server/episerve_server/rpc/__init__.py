"""The daemon's RPC side, in rooms that depend one way (wire <- handlers <- the transports,
grpc and local_plane <- process):

- ``wire``: the codec, bytes in and bytes out; the only modules that import the generated
  classes (``messages``: requests and answers; ``encode``: Read responses without a message
  object, gRPC's ``AnswerWriter``; ``forward``: a Read split for the workers and their
  answers merged back; ``loops``: the codec's compiled or numpy loops);
- ``handlers``: what each RPC does (``service``; ``servicer``: ``Call``, ``Handler``,
  ``AnswerWriter``; ``status``, errors to statuses; ``admission``, ``buffers``,
  ``registry``);
- ``grpc``: gRPC as a transport (``adapter``);
- ``local_plane``: the shared-memory plane for clients on the host, a transport beside gRPC
  (``plane``, listening and calls; ``segment_answer``, a batch laid out in a segment;
  ``conn``, frames; ``peer_limits``, its limits and caps; ``segments``);
- ``process``: standing a server up and taking it down (``server``: the one serve path;
  ``daemon``, ``front``, ``workers``, ``worker``, ``main``; ``interceptors``,
  ``introspection``, ``metrics``, ``logs``).
"""
