"""The HTTP side: the Litestar app and its routes, and the server around it (uvicorn with connection limits)."""
