"""Adapters that put a kernelhost sandbox behind the tool interfaces of agent frameworks.

Each adapter is a module of its own, built on the SDK (``kernelhost.client``) only, and imports
its framework lazily or not at all, so installing kernelhost does not pull every framework in:

- ``kernelhost.integrations.anthropic``: ``handle_code_execution_tool_use(block, sbx)`` answers a
  Messages API ``tool_use`` / ``server_tool_use`` block (no dependency on the ``anthropic``
  package; SDK objects and plain dicts are both accepted).
- ``kernelhost.integrations.openai_agents``: ``code_interpreter_tool()`` returns an OpenAI Agents
  SDK ``FunctionTool`` (``pip install 'kernelhost[openai-agents]'``).
- ``kernelhost.integrations.mcp_server``: the MCP server behind ``kernelhost mcp`` and the
  service's ``/mcp`` endpoint (``pip install 'kernelhost[mcp]'``).
- ``kernelhost.integrations.output``: how an execution is shaped for a model (text budget with a
  head-and-tail truncation marker, images), shared by all of the above.

docs/integrations.md documents each one.
"""
