"""KServe v2 / Open Inference Protocol over gRPC: the proto, its generated modules, the codec."""
