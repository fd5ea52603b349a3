"""The APIs' own shapes: OpenAI chat completions and Responses, Anthropic Messages (bodies, SSE events, parsing of their fields)."""
