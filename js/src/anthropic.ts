/**
 * Anthropic Messages API: answer code-execution tool calls with a kernelhost sandbox.
 *
 * The answer's shape follows the block's `name` (Anthropic's code execution tool, 20250825):
 *
 * | block | answer |
 * | --- | --- |
 * | `tool_use` of your own tool with `{code}` (e.g. `codeExecutionTool()`) or `{command}` | `tool_result`: text, plots as `image` blocks, `is_error` on failure |
 * | `bash_code_execution` `{command}` | `bash_code_execution_tool_result` |
 * | `text_editor_code_execution` view / create / str_replace | `text_editor_code_execution_tool_result` |
 * | `server_tool_use` `code_execution` `{code}` | `code_execution_tool_result` |
 *
 * A `tool_result` goes first in the next `user` message; the server tool's result blocks follow
 * their `server_tool_use` block in the `assistant` message (what a gateway emulating Anthropic's
 * code execution on kernelhost returns), with the API's error codes.
 *
 * ```ts
 * import Anthropic from '@anthropic-ai/sdk';
 * import { Sandbox } from 'kernelhost';
 * import { codeExecutionTool, handleCodeExecutionToolUse } from 'kernelhost/anthropic';
 *
 * const client = new Anthropic();
 * const sbx = await Sandbox.create();
 * const messages = [{ role: 'user', content: 'What is the 20th Fibonacci number?' }];
 * for (;;) {
 *   const response = await client.messages.create({ model, max_tokens: 1024, tools: [codeExecutionTool()], messages });
 *   messages.push({ role: 'assistant', content: response.content });
 *   if (response.stop_reason !== 'tool_use') break;
 *   const results = [];
 *   for (const block of response.content) if (block.type === 'tool_use') results.push(await handleCodeExecutionToolUse(block, sbx));
 *   messages.push({ role: 'user', content: results });
 * }
 * await sbx.close();
 * ```
 */

import { APIError, KernelHostError, NotFoundError, RateLimitError } from './errors.js';
import type { Execution } from './models.js';
import { DEFAULT_BUDGET, type OutputBudget, fitTexts, shapeExecution, truncateText } from './output.js';
import type { Sandbox } from './sandbox.js';
import { DEFAULT_TIMEOUT_SECONDS, type PathStat, type ToolOutput, runForModel, serviceFailure, statPath } from './tools.js';

/** A `tool_use` or `server_tool_use` block of a Messages API response. */
export interface ToolUseBlock {
  type: 'tool_use' | 'server_tool_use' | string;
  id: string;
  name: string;
  input: unknown;
}

/** The answer: a `tool_result` or one of the code execution tool's result blocks. */
export type ToolAnswer = Record<string, unknown> & { type: string; tool_use_id: string };

export interface HandleOptions {
  /** Seconds before code is interrupted (default 120). */
  timeoutSeconds?: number;
  /** Caps the text returned to the model. */
  budget?: OutputBudget;
}

/** The largest file `view` and `str_replace` read (bytes). */
export const VIEW_MAX_BYTES = 10 * 1024 * 1024;

export const DEFAULT_DESCRIPTION =
  'Run Python code in a persistent Jupyter kernel inside an isolated VM. Variables, imports and files persist ' +
  'between calls, as in a notebook. Returns stdout, stderr, the value of the last expression and any error ' +
  'with its traceback; plots and images come back as images. Use print() to see values.';

/**
 * A client tool that runs Python, for `tools` of `messages.create`. The default name is not
 * `code_execution`, which belongs to Anthropic's server tool.
 */
export function codeExecutionTool(name = 'run_python', description = DEFAULT_DESCRIPTION) {
  return {
    name,
    description,
    input_schema: {
      type: 'object' as const,
      properties: { code: { type: 'string', description: 'Python source to run in the kernel' } },
      required: ['code'],
    },
  };
}

/** Anthropic's code execution server tool definition (`code_execution_<version>`). */
export function serverCodeExecutionTool(version = '20250825') {
  if (!/^\d{8}$/.test(version)) throw new RangeError(`version=${JSON.stringify(version)}: use a date such as '20250825'`);
  return { type: `code_execution_${version}`, name: 'code_execution' as const };
}

class BadInput extends Error {}

function serviceErrorCode(error: unknown): string {
  serviceFailure(error); // a bad key or a closed sandbox throws: the developer must act
  return error instanceof RateLimitError ? 'too_many_requests' : 'unavailable';
}

function asBlock(block: unknown): ToolUseBlock {
  if (typeof block !== 'object' || block === null) {
    throw new TypeError(`expected a tool_use block, got ${typeof block}: pass the items of response.content whose type is 'tool_use'`);
  }
  const b = block as Record<string, unknown>;
  if (b.type !== 'tool_use' && b.type !== 'server_tool_use') {
    throw new TypeError(`block type ${JSON.stringify(b.type)} is not a tool call: pass only blocks whose type is 'tool_use' (or 'server_tool_use')`);
  }
  if (typeof b.id !== 'string' || typeof b.name !== 'string') {
    throw new TypeError(`the ${String(b.type)} block has no string 'id' and 'name'`);
  }
  return { type: b.type, id: b.id, name: b.name, input: b.input };
}

/**
 * Run a code-execution block from a Messages API response in `sandbox` and return the block
 * that answers it (see the module comment). A failing cell is an answer, never a throw.
 */
export async function handleCodeExecutionToolUse(
  block: ToolUseBlock | Record<string, unknown>,
  sandbox: Sandbox,
  options: HandleOptions = {},
): Promise<ToolAnswer> {
  const b = asBlock(block);
  const args = typeof b.input === 'object' && b.input !== null ? (b.input as Record<string, unknown>) : {};
  const timeout = options.timeoutSeconds ?? DEFAULT_TIMEOUT_SECONDS;
  const budget = options.budget ?? DEFAULT_BUDGET;
  if (b.name === 'bash_code_execution') return bashResult(b.id, args, sandbox, timeout, budget);
  if (b.name === 'text_editor_code_execution') return editorResult(b.id, args, sandbox, budget);
  if (b.type === 'server_tool_use') {
    if (b.name !== 'code_execution') {
      throw new TypeError(`server tool ${JSON.stringify(b.name)} is not code execution; kernelhost answers code_execution, bash_code_execution and text_editor_code_execution only`);
    }
    return codeResult(b.id, args, sandbox, timeout, budget);
  }
  let output: ToolOutput;
  if (typeof args.code === 'string') output = await runForModel(sandbox, args.code, 'python', timeout, budget);
  else if (typeof args.command === 'string') output = await runForModel(sandbox, args.command, 'bash', timeout, budget);
  else {
    output = {
      text: `Invalid input with keys ${JSON.stringify(Object.keys(args).sort())}: pass 'code' (a string of Python source) to run code, or 'command' (a string) to run a shell command.`,
      images: [],
      isError: true,
    };
  }
  return {
    type: 'tool_result',
    tool_use_id: b.id,
    content: [
      { type: 'text', text: output.text },
      ...output.images.map((image) => ({
        type: 'image',
        source: { type: 'base64', media_type: image.mimeType, data: image.data },
      })),
    ],
    is_error: output.isError,
  };
}

async function codeResult(id: string, args: Record<string, unknown>, sandbox: Sandbox, timeout: number, budget: OutputBudget): Promise<ToolAnswer> {
  const answer = (content: Record<string, unknown>): ToolAnswer => ({ type: 'code_execution_tool_result', tool_use_id: id, content });
  const error = (code: string) => answer({ type: 'code_execution_tool_result_error', error_code: code });
  if (typeof args.code !== 'string') return error('invalid_tool_input');
  let execution: Execution;
  try {
    execution = await sandbox.runCode(args.code, { timeoutSeconds: timeout });
  } catch (e) {
    return error(serviceErrorCode(e));
  }
  if (execution.status === 'timeout') return error('execution_time_exceeded');
  const shaped = shapeExecution(execution, budget);
  const [[stdout, stderr]] = fitTexts([shaped.toText({ stderr: false, empty: '' }), shaped.stderr], budget.maxChars, budget.headFraction);
  return answer({ type: 'code_execution_result', stdout, stderr, return_code: shaped.isError ? 1 : 0, content: [] });
}

async function bashResult(id: string, args: Record<string, unknown>, sandbox: Sandbox, timeout: number, budget: OutputBudget): Promise<ToolAnswer> {
  const answer = (content: Record<string, unknown>): ToolAnswer => ({ type: 'bash_code_execution_tool_result', tool_use_id: id, content });
  const error = (code: string) => answer({ type: 'bash_code_execution_tool_result_error', error_code: code });
  if (typeof args.command !== 'string' || !args.command.trim()) return error('invalid_tool_input');
  let execution: Execution;
  try {
    execution = await sandbox.runCode(args.command, { language: 'bash', timeoutSeconds: timeout });
  } catch (e) {
    return error(serviceErrorCode(e));
  }
  if (execution.status === 'timeout') return error('execution_time_exceeded');
  if (execution.exitCode === null) return error('unavailable'); // cut off: processes killed, VM lost
  const [[stdout, stderr]] = fitTexts([execution.stdout, execution.stderr], budget.maxChars, budget.headFraction);
  return answer({ type: 'bash_code_execution_result', stdout, stderr, return_code: execution.exitCode, content: [] });
}

class FileNotFound extends Error {}

/** Make one files call; turn the errors that concern the path into the tool's own. */
async function fileCall<T>(path: string, call: () => Promise<T>): Promise<T> {
  try {
    return await call();
  } catch (e) {
    if (e instanceof NotFoundError && e.code === 'file_not_found') throw new FileNotFound(`${path} does not exist`);
    if (e instanceof APIError && ['file_operation_failed', 'file_too_large', 'invalid_request'].includes(e.code)) {
      throw new BadInput(String(e.details.message ?? e.message));
    }
    throw e;
  }
}

async function readFile(sandbox: Sandbox, path: string, stat?: PathStat): Promise<Buffer> {
  const known = stat ?? (await statPath(sandbox, path));
  if (known.kind === 'dir') throw new BadInput(`${path} is a directory, not a file`);
  if (known.size > VIEW_MAX_BYTES) {
    throw new BadInput(`${path} is ${known.size} bytes, over the ${VIEW_MAX_BYTES}-byte limit here; work on it with a bash command instead`);
  }
  return Buffer.from(await fileCall(path, () => sandbox.files.read(path)));
}

const MAGIC: Array<[number[], 'image' | 'pdf']> = [
  [[0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a], 'image'],
  [[0xff, 0xd8, 0xff], 'image'],
  [[0x47, 0x49, 0x46, 0x38], 'image'],
  [[0x25, 0x50, 0x44, 0x46, 0x2d], 'pdf'],
];

async function editorResult(id: string, args: Record<string, unknown>, sandbox: Sandbox, budget: OutputBudget): Promise<ToolAnswer> {
  const answer = (content: Record<string, unknown>): ToolAnswer => ({ type: 'text_editor_code_execution_tool_result', tool_use_id: id, content });
  const error = (code: string, message?: string) =>
    answer({ type: 'text_editor_code_execution_tool_result_error', error_code: code, ...(message === undefined ? {} : { error_message: message }) });
  const { command, path } = args;
  try {
    if (command !== 'view' && command !== 'create' && command !== 'str_replace') {
      throw new BadInput(`command ${JSON.stringify(command)} is not one of view, create, str_replace`);
    }
    if (typeof path !== 'string' || !path) throw new BadInput("'path' must be a non-empty string (a file path)");
    if (command === 'create') {
      if (typeof args.file_text !== 'string') throw new BadInput("create needs 'file_text' (a string)");
      const before = await statPath(sandbox, path);
      if (before.kind === 'dir') throw new BadInput(`${path} is a directory; name a file to create`);
      const text = args.file_text;
      await fileCall(path, () => sandbox.files.write(path, text));
      return answer({ type: 'text_editor_code_execution_create_result', is_file_update: before.kind !== 'missing' });
    }
    if (command === 'view') return answer(await view(sandbox, path, args.view_range, budget));
    return answer(await strReplace(sandbox, path, args));
  } catch (e) {
    if (e instanceof BadInput) return error('invalid_tool_input', e.message);
    if (e instanceof FileNotFound) return error('file_not_found', e.message);
    if (e instanceof KernelHostError) return error(serviceErrorCode(e), e.message);
    throw e;
  }
}

async function view(sandbox: Sandbox, path: string, viewRange: unknown, budget: OutputBudget): Promise<Record<string, unknown>> {
  const result = { type: 'text_editor_code_execution_view_result' };
  const stat = await statPath(sandbox, path);
  if (stat.kind === 'dir') {
    const entries = await fileCall(path, () => sandbox.files.list(path));
    const listing = entries.map((e) => e.name + (e.type === 'dir' ? '/' : '')).join('\n');
    const count = listing ? listing.split('\n').length : 0;
    return { ...result, file_type: 'text', content: listing, num_lines: count, start_line: 1, total_lines: count };
  }
  const raw = await readFile(sandbox, path, stat);
  for (const [magic, fileType] of MAGIC) {
    if (magic.every((byte, i) => raw[i] === byte)) return { ...result, file_type: fileType, content: raw.toString('base64') };
  }
  const lines = splitLinesKeepEnds(raw.toString('utf8'));
  let start = 1;
  let end = lines.length;
  if (Array.isArray(viewRange) && viewRange.length === 2 && viewRange.every(Number.isInteger)) {
    start = Math.max(1, viewRange[0] as number);
    end = viewRange[1] === -1 ? lines.length : Math.min(lines.length, viewRange[1] as number);
  }
  const shown = lines.slice(start - 1, end).join('');
  return {
    ...result,
    file_type: 'text',
    content: truncateText(shown, budget.maxChars, budget.headFraction),
    num_lines: Math.max(0, end - start + 1),
    start_line: start,
    total_lines: lines.length,
  };
}

/** Python's `str.splitlines(keepends=True)` for \n, \r\n and \r line ends. */
function splitLinesKeepEnds(text: string): string[] {
  return text.match(/[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$/g) ?? [];
}

async function strReplace(sandbox: Sandbox, path: string, args: Record<string, unknown>): Promise<Record<string, unknown>> {
  const oldStr = args.old_str;
  const newStr = args.new_str ?? '';
  if (typeof oldStr !== 'string' || !oldStr || typeof newStr !== 'string') {
    throw new BadInput("str_replace needs 'old_str' (a non-empty string) and 'new_str' (a string)");
  }
  const raw = await readFile(sandbox, path);
  let text: string;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(raw);
  } catch {
    throw new BadInput(`${path} is not UTF-8 text`);
  }
  const count = text.split(oldStr).length - 1;
  if (count !== 1) {
    throw new BadInput(
      count === 0
        ? `old_str was not found in ${path}`
        : `old_str occurs ${count} times in ${path}; include more surrounding lines so that it occurs exactly once`,
    );
  }
  const at = text.indexOf(oldStr);
  const updated = text.slice(0, at) + newStr + text.slice(at + oldStr.length);
  await fileCall(path, () => sandbox.files.write(path, updated));
  // The hunk, in whole lines: the lines old_str touched, before and after the replacement.
  const lineStart = at === 0 ? 0 : text.lastIndexOf('\n', at - 1) + 1;
  const newline = text.indexOf('\n', at + oldStr.length);
  const lineEnd = newline < 0 ? text.length : newline;
  const before = text.slice(lineStart, lineEnd).split('\n');
  const after = (text.slice(lineStart, at) + newStr + text.slice(at + oldStr.length, lineEnd)).split('\n');
  const start = text.slice(0, at).split('\n').length;
  return {
    type: 'text_editor_code_execution_str_replace_result',
    old_start: start,
    old_lines: before.length,
    new_start: start,
    new_lines: after.length,
    lines: [...before.map((l) => `-${l}`), ...after.map((l) => `+${l}`)],
  };
}
