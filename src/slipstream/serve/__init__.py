"""Low-latency serving: a batching engine over planned static shapes, an HTTP app, a load generator.

Nothing heavy is imported here; import the submodules you need (`slipstream.serve.engine`,
`slipstream.serve.app`, `slipstream.serve.loadgen`, `slipstream.serve.generate`).
"""
