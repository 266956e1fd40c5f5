"""What every package may share: the wire's primitives (`common.wire`), the request/reply channel
(`common.channel`), the config base (`common.config`), memory and log guards for services
(`common.guards`) and the explicit ready signal (`common.ready`). Imports nothing of the project;
`buffer/` and `weight_sync/` import this package and still not each other.
"""
