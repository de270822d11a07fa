"""Code shared by every service: config, NATS bus, gRPC lifecycle, telemetry, generated stubs.

The weight channel (`services.common.weights`) is the only part that imports torch;
controller, replay and environment never import it.
"""
