"""Tool calls: the request's tools rendered through the checkpoint's chat template, and the
model's answer parsed back into OpenAI ``tool_calls`` (whole, or as a stream of deltas).

``formats`` knows the three ways our families write a call (Hermes tags, Llama 3.x JSON, GPT-OSS's
harmony channels); ``requests`` validates tools, ``tool_choice`` and tool messages and turns a
forced choice into a grammar; ``stream`` splits streamed text into content and calls.
"""

from p2pserve.client.tools.formats import ToolCall, detect_format, parse_tool_calls
from p2pserve.client.tools.requests import ToolRequest, parse_tools
from p2pserve.client.tools.stream import ToolStream

__all__ = ["ToolCall", "ToolRequest", "ToolStream", "detect_format", "parse_tool_calls", "parse_tools"]
