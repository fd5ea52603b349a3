"""What clients send, parsed and checked before any logic touches it: the API error type, field shapes, request schemas, images and videos fetched and decoded, text normalisation."""
