/**
 * Vercel AI SDK (`ai` v7): the parts of a tool that runs code in a kernelhost sandbox, to pass
 * to `tool()`.
 *
 * ```ts
 * import { generateText, isStepCount, tool } from 'ai';
 * import { kernelhostRunCode } from 'kernelhost/ai-sdk';
 *
 * const runCode = kernelhostRunCode({ template: 'python' });
 * try {
 *   const { text } = await generateText({
 *     model,
 *     tools: { runCode: tool(runCode) },
 *     stopWhen: isStepCount(5), // the default is one step: the model would never see the result
 *     prompt: 'What is 2**100?',
 *   });
 * } finally {
 *   await runCode.close(); // deletes the sandbox it created
 * }
 * ```
 *
 * `inputSchema` is a Standard Schema with a JSON Schema converter, so this module needs no
 * import of `ai` or zod. `execute` returns a JSON object (`text`, `isError`, `images`);
 * `toModelOutput` gives the model the text and the images as file parts.
 */

import { DEFAULT_BUDGET, type OutputBudget, outputBudget } from './output.js';
import { DEFAULT_TIMEOUT_SECONDS, LANGUAGES, type Language, LazySandbox, type LazySandboxOptions, runForModel } from './tools.js';

export const DEFAULT_DESCRIPTION =
  'Run code in a persistent Jupyter kernel inside an isolated VM. With language "python" (the default) the ' +
  'code runs in the kernel: variables, imports and files persist between calls, as in a notebook. With ' +
  'language "bash" it is run as a shell command. Returns stdout, stderr, the value of the last expression ' +
  'and any error with its traceback; plots come back as images.';

export interface RunCodeToolOptions extends LazySandboxOptions {
  description?: string;
  /** Seconds before code is interrupted (default 120). */
  timeoutSeconds?: number;
  /** Caps the text (and images) returned to the model. */
  budget?: Partial<OutputBudget>;
}

/** The tool's input. */
export interface RunCodeInput {
  code: string;
  language?: Language;
}

/** The tool's output (a JSON value, as `ai` requires). */
export interface RunCodeOutput {
  /** Everything the code produced as text, within the budget. */
  text: string;
  /** True if the code raised, timed out or a command exited non-zero. */
  isError: boolean;
  /** Images (plots) the code displayed. */
  images: Array<{ mediaType: string; data: string }>;
}

const JSON_SCHEMA = {
  type: 'object',
  properties: {
    code: { type: 'string', description: 'Python source, or a bash command' },
    language: { type: 'string', enum: [...LANGUAGES], description: '"python" (default: the kernel) or "bash" (a shell command)' },
  },
  required: ['code'],
  additionalProperties: false,
} as const;

type Issue = { message: string; path?: ReadonlyArray<PropertyKey> };
type ValidateResult = { value: RunCodeInput; issues?: undefined } | { issues: ReadonlyArray<Issue> };

/** The input schema as a Standard Schema v1 (validate) with a Standard JSON Schema converter. */
export const inputSchema = {
  '~standard': {
    version: 1 as const,
    vendor: 'kernelhost',
    validate(value: unknown): ValidateResult {
      if (typeof value !== 'object' || value === null || Array.isArray(value)) {
        return { issues: [{ message: 'expected an object with a "code" string' }] };
      }
      const { code, language, ...rest } = value as Record<string, unknown>;
      const issues: Issue[] = [];
      if (typeof code !== 'string') issues.push({ message: '"code" must be a string', path: ['code'] });
      if (language !== undefined && !(LANGUAGES as readonly unknown[]).includes(language)) {
        issues.push({ message: `"language" must be one of ${LANGUAGES.join(', ')}`, path: ['language'] });
      }
      for (const key of Object.keys(rest)) issues.push({ message: `unknown property "${key}"`, path: [key] });
      if (issues.length) return { issues };
      return { value: { code: code as string, ...(language === undefined ? {} : { language: language as Language }) } };
    },
    jsonSchema: {
      input: (_options: { target: string }) => structuredClone(JSON_SCHEMA) as Record<string, unknown>,
      output: (_options: { target: string }) => structuredClone(JSON_SCHEMA) as Record<string, unknown>,
    },
    types: undefined as unknown as { input: unknown; output: RunCodeInput } | undefined,
  },
};

/**
 * The description, inputSchema, execute and toModelOutput of a code-running tool for `tool()` of
 * `ai` v7, plus `close()`, which deletes the sandbox it created on its first call (a `sandbox`
 * passed in is left to its owner).
 */
export function kernelhostRunCode(options: RunCodeToolOptions = {}) {
  const lazy = new LazySandbox(options);
  const budget = options.budget ? outputBudget(options.budget) : DEFAULT_BUDGET;
  const timeout = options.timeoutSeconds ?? DEFAULT_TIMEOUT_SECONDS;
  return {
    description: options.description ?? DEFAULT_DESCRIPTION,
    inputSchema,
    /** Run the code; failures of the code come back as the output, not as a throw. */
    async execute(input: RunCodeInput): Promise<RunCodeOutput> {
      const output = await runForModel(await lazy.get(), input.code, input.language ?? 'python', timeout, budget);
      return {
        text: output.text,
        isError: output.isError,
        images: output.images.map((image) => ({ mediaType: image.mimeType, data: image.data })),
      };
    },
    /** The text for the model, and the images as file parts. */
    toModelOutput({ output }: { output: RunCodeOutput }) {
      if (output.images.length === 0) return { type: 'text' as const, value: output.text };
      return {
        type: 'content' as const,
        value: [
          { type: 'text' as const, text: output.text },
          ...output.images.map((image) => ({
            type: 'file' as const,
            mediaType: image.mediaType,
            data: { type: 'data' as const, data: image.data },
          })),
        ],
      };
    },
    /** Delete the sandbox this tool created, if any. */
    close: () => lazy.close(),
    /** The sandbox in use (created on first call unless one was passed). */
    sandbox: () => lazy.get(),
  };
}
