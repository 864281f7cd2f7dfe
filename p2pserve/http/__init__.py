"""The HTTP edge: the guarded h11 protocol and the embedded uvicorn server that the OpenAI API
(:mod:`p2pserve.http.openai`) and the dashboard share. It may import the client library; the
client never imports it."""
