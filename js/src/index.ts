/**
 * kernelhost: a client for a self-hosted code interpreter whose sandboxes are VMs running
 * Jupyter kernels.
 *
 * - `kernelhost`: `Sandbox` (create, runCode with streaming callbacks, fork, files, close),
 *   errors, and the output shaping the adapters use.
 * - `kernelhost/anthropic`: `handleCodeExecutionToolUse` for the Messages API.
 * - `kernelhost/openai-agents`: `kernelhostCodeInterpreter()` for `tool()` of `@openai/agents`.
 * - `kernelhost/ai-sdk`: `kernelhostRunCode()` for `tool()` of `ai` v7.
 */

export {
  APIError,
  AuthenticationError,
  ConflictError,
  InvalidRequestError,
  KernelHostError,
  KernelHostTimeout,
  NotFoundError,
  RateLimitError,
  ServerError,
  TransportError,
} from './errors.js';
export type { ClientOptions } from './http.js';
export type {
  Checkpoint,
  Execution,
  ExecutionError,
  ExecutionStatus,
  FileInfo,
  NetworkMode,
  NetworkSpec,
  Recovery,
  Result,
  SandboxInfo,
  SandboxMetrics,
  SandboxState,
} from './models.js';
export { EXECUTION_STATUSES, RECOVERIES, SANDBOX_STATES } from './models.js';
export {
  DEFAULT_BUDGET,
  MIN_MAX_CHARS,
  fitTexts,
  outputBudget,
  shapeExecution,
  stripAnsi,
  truncateText,
} from './output.js';
export type { Image, OutputBudget, ShapedExecution } from './output.js';
export { Sandbox } from './sandbox.js';
export type { CreateOptions, RunCodeOptions, SandboxFiles } from './sandbox.js';
