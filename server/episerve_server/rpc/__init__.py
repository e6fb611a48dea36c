"""The daemon's RPC side, in four rooms that depend one way (wire <- handlers <- local <-
process):

- ``wire``: the codec, bytes in and bytes out; the only modules that import the generated
  classes (``convert``: requests and answers; ``encode``: Read responses without a message
  object; ``forward``: a Read split for the workers and their answers merged back);
- ``handlers``: what each RPC does (``service``; ``status``, errors to statuses;
  ``buffers``, ``registry``);
- ``local``: the shared-memory plane for clients on the host, a transport beside gRPC
  (``plane``, listening and calls; ``answer``, a Read's answer laid out in a segment;
  ``conn``, frames; ``guard``, its limits and caps; ``segments``);
- ``process``: standing a server up and taking it down (``server``: the one serve path;
  ``daemon``, ``front``, ``workers``, ``worker``, ``main``; ``interceptors``,
  ``introspection``, ``metrics``, ``logs``).
"""
