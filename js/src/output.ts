/**
 * How the outcome of running code is shaped for a language model (the same rules as the
 * Python package's `kernelhost.integrations.output`).
 *
 * A budget caps the characters a tool returns; text over it keeps its head and its tail (where
 * tracebacks and final results are) around a visible marker:
 * `[... 48213 of 60000 characters truncated ...]`. Images are split out as base64.
 */

import type { Execution, Result } from './models.js';

/** The smallest `maxChars` an `OutputBudget` accepts. */
export const MIN_MAX_CHARS = 100;
/** MIME types handed to models as images, in order of preference. */
export const IMAGE_MIME_TYPES = ['image/png', 'image/jpeg', 'image/gif', 'image/webp'] as const;

const marker = (omitted: number, total: number): string =>
  `\n[... ${omitted} of ${total} characters truncated ...]\n`;
const shortMarker = (omitted: number): string => `[...${omitted} cut...]`;
// eslint-disable-next-line no-control-regex
const ANSI = /\u001b\[[0-?]*[ -/]*[@-~]|\u001b[@-Z\\-_]/g;

/** Limits on what one tool call hands back to a model. */
export interface OutputBudget {
  /** Characters of text (default 20000); longer text keeps a head and a tail. */
  maxChars: number;
  /** Share of the kept characters taken from the head, 0..1 (default 0.5). */
  headFraction: number;
  /** Images attached at most (default 4). */
  maxImages: number;
  /** Base64 characters of all images together at most (default 8 MiB). */
  maxImageBytes: number;
}

export const DEFAULT_BUDGET: Readonly<OutputBudget> = Object.freeze({
  maxChars: 20_000,
  headFraction: 0.5,
  maxImages: 4,
  maxImageBytes: 8 * 1024 * 1024,
});

/** A full budget from a partial one, checked; the error names the value and the fix. */
export function outputBudget(partial: Partial<OutputBudget> = {}): OutputBudget {
  const budget = { ...DEFAULT_BUDGET, ...partial };
  if (!Number.isInteger(budget.maxChars) || budget.maxChars < MIN_MAX_CHARS) {
    throw new RangeError(`maxChars=${budget.maxChars}: use an integer of at least ${MIN_MAX_CHARS}, so the truncation marker and some output fit`);
  }
  if (!(budget.headFraction >= 0 && budget.headFraction <= 1)) {
    throw new RangeError(`headFraction=${budget.headFraction}: use a number from 0 (keep only the tail) to 1 (keep only the head)`);
  }
  if (budget.maxImages < 0 || budget.maxImageBytes < 0) {
    throw new RangeError(`maxImages=${budget.maxImages}, maxImageBytes=${budget.maxImageBytes}: use 0 or more (0 sends no images)`);
  }
  return budget;
}

/**
 * `text` if it fits in `maxChars`; else its head and tail around a marker that says how much
 * was cut. The marker counts towards `maxChars`, so the result is never longer.
 */
export function truncateText(text: string, maxChars: number, headFraction = 0.5): string {
  if (maxChars < 0) throw new RangeError(`maxChars=${maxChars}: use 0 or more characters`);
  const total = text.length;
  if (total <= maxChars) return text;
  const markers: Array<[(omitted: number) => string, number]> = [
    [(omitted) => marker(omitted, total), 20],
    [shortMarker, 0],
  ];
  for (const [make, leastKept] of markers) {
    // The marker's length depends on the count it shows: start from a lower bound and give up
    // kept characters until everything fits.
    let keep = maxChars - make(total - maxChars).length;
    while (keep >= 0 && keep + make(total - keep).length > maxChars) keep -= 1;
    if (keep >= leastKept) {
      const head = Math.round(keep * headFraction);
      const tail = keep - head;
      return text.slice(0, head) + make(total - keep) + text.slice(total - tail);
    }
  }
  return text.slice(0, maxChars);
}

/**
 * Share `maxChars` among several texts (short ones keep everything, the rest is shared among
 * the long ones) and truncate each to its share. Returns the texts and whether any was cut.
 */
export function fitTexts(texts: string[], maxChars: number, headFraction = 0.5): [string[], boolean] {
  const shares = texts.map(() => 0);
  let remaining = maxChars;
  const pending = texts.map((_, i) => i).sort((a, b) => texts[a]!.length - texts[b]!.length);
  while (pending.length > 0) {
    const fair = Math.floor(remaining / pending.length);
    const first = pending[0]!;
    if (texts[first]!.length <= fair) {
      shares[first] = texts[first]!.length;
      remaining -= shares[first]!;
      pending.shift();
      continue;
    }
    for (const j of pending) shares[j] = fair;
    shares[pending[pending.length - 1]!]! += remaining - fair * pending.length;
    break;
  }
  const out = texts.map((t, i) => (t.length <= shares[i]! ? t : truncateText(t, shares[i]!, headFraction)));
  return [out, texts.some((t, i) => t.length > shares[i]!)];
}

/** Remove terminal colour and cursor escapes (IPython colours its tracebacks). */
export function stripAnsi(text: string): string {
  return text.replace(ANSI, '');
}

/** One image output, base64 encoded. */
export interface Image {
  mimeType: string;
  data: string;
}

function resultText(result: Result): string {
  const data = result.data;
  for (const mime of ['text/plain', 'text/markdown', 'text/latex', 'text/html']) {
    const value = data[mime];
    if (typeof value === 'string') return value;
  }
  if ('application/json' in data) return JSON.stringify(data['application/json']);
  return `<output of type ${Object.keys(data).join(', ') || 'unknown'}>`;
}

function resultImage(result: Result): Image | null {
  for (const mime of IMAGE_MIME_TYPES) {
    const value = result.data[mime];
    if (typeof value === 'string' && value) return { mimeType: mime, data: value.replace(/\n/g, '') };
  }
  return null;
}

const STATUS_NOTES: Record<string, string> = {
  timeout: '[timed out: the code ran past its time limit and was interrupted; what it had done before that is kept]',
  kernel_died:
    '[the kernel died (out of memory or a crash) and was restarted: every variable and import is gone]',
  restarted: '[the kernel was restarted while this ran: every variable and import is gone]',
  interrupted: '[interrupted before it finished]',
  restored:
    '[the sandbox was rewound to a checkpoint while this ran: its variables and files are as they were at that checkpoint]',
};
/** The error a bash command gets for a non-zero exit; the exit code note says it already. */
const COMMAND_FAILED = 'CommandFailed';

/** An execution as a model should see it. Build it with `shapeExecution`. */
export interface ShapedExecution {
  status: string;
  executionCount: number | null;
  stdout: string;
  stderr: string;
  /** Text of the cell's value, if any. */
  result: string | null;
  /** Text of the other rich outputs; images as placeholders. */
  outputs: string[];
  error: { name: string; value: string; traceback: string } | null;
  /** A bash command's exit status. */
  exitCode: number | null;
  images: Image[];
  omittedImages: number;
  /** True when the code raised, timed out, or its kernel died. */
  isError: boolean;
  /** Everything in one text within the budget (`stderr: false` leaves stderr out). */
  toText(options?: { stderr?: boolean; empty?: string }): string;
}

/** Shape an execution for a model (see the module comment). */
export function shapeExecution(execution: Execution, budget: OutputBudget = DEFAULT_BUDGET): ShapedExecution {
  const images: Image[] = [];
  let omittedImages = 0;
  let imageBytes = 0;
  const outputs: string[] = [];
  let main: string | null = null;
  for (const result of execution.results) {
    const image = resultImage(result);
    let text: string;
    if (image) {
      if (images.length < budget.maxImages && imageBytes + image.data.length <= budget.maxImageBytes) {
        images.push(image);
        imageBytes += image.data.length;
        text = `<image ${images.length}: ${image.mimeType}, attached>`;
      } else {
        omittedImages += 1;
        text = `<image: ${image.mimeType}, not attached>`;
      }
    } else {
      text = stripAnsi(resultText(result));
    }
    if (result.isMainResult) main = text;
    else outputs.push(text);
  }
  const err = execution.error;
  const error = err
    ? {
        name: err.name,
        value: err.value,
        traceback: err.traceback.length ? err.traceback.map(stripAnsi).join('\n') : `${err.name}: ${err.value}`,
      }
    : null;
  const stdout = stripAnsi(execution.stdout);
  const stderr = stripAnsi(execution.stderr);
  const notes: string[] = [];
  if (execution.status in STATUS_NOTES) notes.push(STATUS_NOTES[execution.status]!);
  if (execution.exitCode !== null) notes.push(`[exit code ${execution.exitCode}]`);
  if (omittedImages) {
    notes.push(`[${omittedImages} more image(s) not shown: over the tool's image budget; save them to files instead]`);
  }
  return {
    status: execution.status,
    executionCount: execution.executionCount,
    stdout,
    stderr,
    result: main,
    outputs,
    error,
    exitCode: execution.exitCode,
    images,
    omittedImages,
    isError: execution.status !== 'ok' || error !== null,
    toText({ stderr: withStderr = true, empty = '[no output]' } = {}) {
      const parts: string[] = [];
      if (stdout) parts.push(stdout.replace(/\n+$/, ''));
      if (stderr && withStderr) parts.push('[stderr]\n' + stderr.replace(/\n+$/, ''));
      parts.push(...outputs);
      if (main !== null) parts.push(`${execution.executionCount === null ? 'Out' : `Out[${execution.executionCount}]`}: ${main}`);
      if (error && !(execution.exitCode !== null && error.name === COMMAND_FAILED)) parts.push(error.traceback);
      parts.push(...notes);
      const text = parts.length ? parts.join('\n') : empty;
      return truncateText(text, budget.maxChars, budget.headFraction);
    },
  };
}
