"""The contract every part shares: domain types, errors, the block-hash spec, protobuf conversions."""
