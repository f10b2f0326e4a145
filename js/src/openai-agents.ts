/**
 * OpenAI Agents SDK (`@openai/agents`): the parts of a function tool that runs code in a
 * kernelhost sandbox, to pass to `tool()`.
 *
 * ```ts
 * import { Agent, run, tool } from '@openai/agents';
 * import { kernelhostCodeInterpreter } from 'kernelhost/openai-agents';
 *
 * const interpreter = kernelhostCodeInterpreter({ template: 'python' });
 * const agent = new Agent({ name: 'analyst', instructions: 'Use run_code to compute.', tools: [tool(interpreter)] });
 * try {
 *   const result = await run(agent, 'What is 2**100?');
 * } finally {
 *   await interpreter.close(); // deletes the sandbox it created
 * }
 * ```
 *
 * The tool takes `code` and `language` (`python` in the persistent kernel, `bash` as a shell
 * command). Code that fails returns its traceback as the output (the run goes on); plots come
 * back as image outputs.
 */

import { DEFAULT_BUDGET, type OutputBudget, outputBudget } from './output.js';
import { DEFAULT_TIMEOUT_SECONDS, LANGUAGES, LazySandbox, type LazySandboxOptions, runForModel } from './tools.js';

export const DEFAULT_DESCRIPTION =
  "Run code in a persistent Jupyter kernel inside an isolated VM. With language 'python' the code runs in " +
  'the kernel: variables, imports and files persist between calls, as in a notebook. With language ' +
  "'bash' it is run as a shell command. Returns stdout, stderr, the value of the last expression and any " +
  'error with its traceback; plots come back as images.';

export interface CodeInterpreterOptions extends LazySandboxOptions {
  /** The tool's name (default `run_code`; `code_interpreter` is OpenAI's hosted tool). */
  name?: string;
  description?: string;
  /** Seconds before code is interrupted (default 120). */
  timeoutSeconds?: number;
  /** Caps the text (and images) returned to the model. */
  budget?: Partial<OutputBudget>;
}

/** The tool's input. */
export interface CodeInterpreterInput {
  code: string;
  language: (typeof LANGUAGES)[number];
}

/** One item of the tool's output, as `@openai/agents` accepts it from `execute`. */
export type CodeInterpreterOutputItem =
  | { type: 'text'; text: string }
  | { type: 'image'; image: { data: string; mediaType: string } };

/** The JSON schema of the input (strict: every property required, no others). */
export const PARAMETERS = {
  type: 'object' as const,
  properties: {
    code: { type: 'string', description: 'Python source, or a bash command' },
    language: { type: 'string', enum: [...LANGUAGES], description: "'python' (the kernel) or 'bash' (a shell command)" },
  },
  required: ['code', 'language'] as Array<'code' | 'language'>,
  additionalProperties: false as const,
};

/**
 * The name, description, parameters and execute of a code interpreter tool for `tool()` of
 * `@openai/agents`, plus `close()`, which deletes the sandbox it created on its first call
 * (a `sandbox` passed in is left to its owner).
 */
export function kernelhostCodeInterpreter(options: CodeInterpreterOptions = {}) {
  const lazy = new LazySandbox(options);
  const budget = options.budget ? outputBudget(options.budget) : DEFAULT_BUDGET;
  const timeout = options.timeoutSeconds ?? DEFAULT_TIMEOUT_SECONDS;
  return {
    name: options.name ?? 'run_code',
    description: options.description ?? DEFAULT_DESCRIPTION,
    parameters: PARAMETERS,
    strict: true as const,
    /** Run the code; failures of the code come back as the output, not as a throw. */
    async execute(input: unknown): Promise<string | CodeInterpreterOutputItem[]> {
      const args = (typeof input === 'string' ? JSON.parse(input) : input) as Partial<CodeInterpreterInput> | null;
      if (!args || typeof args.code !== 'string') return "Missing 'code': pass the source to run as a string.";
      const output = await runForModel(await lazy.get(), args.code, args.language ?? 'python', timeout, budget);
      if (output.images.length === 0) return output.text;
      return [
        { type: 'text', text: output.text },
        ...output.images.map((image) => ({ type: 'image' as const, image: { data: image.data, mediaType: image.mimeType } })),
      ];
    },
    /** Delete the sandbox the tool created, if any. */
    close: () => lazy.close(),
    /** The sandbox in use (created on first call unless one was passed). */
    sandbox: () => lazy.get(),
  };
}
