"""The chat page: header (title, context used), messages, live readout, prompt box.

The view of a conversation: the answer in progress is `ChatSession`'s (chat_session.py:
buffered tokens flushed about 25 times a second to the database and then here, so whatever is
on screen is also on disk); this page turns the session's and the client's signals into widgets.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut, QTextCursor
from PySide6.QtWidgets import QFrame, QHBoxLayout, QMenu, QMessageBox, QPushButton, QToolButton, QVBoxLayout, QWidget

from app.server.tools import for_template
from app.settings import DEFAULT_SYSTEM_PROMPT, Settings
from app.storage import COMPLETE, FAILED, STREAMING, WRITE_ERRORS, Conversation, Storage

from . import formatting as fmt
from .chat_session import AnswerStats, ChatSession
from .chat_view import ChatView
from .chat_widgets import Banner, ElidedLabel
from engine.runtime.chat_request import ChatRequest
from engine.runtime.context_policy import answer_room
from .context_readout import ContextReadout
from .dialogs import ConversationSettingsDialog, show_error
from .drafts import DRAFT_TAG, Drafts
from .input_box import InputBar
from .live_readout import LiveReadout, live_text
from .worker import EngineClient

log = logging.getLogger(__name__)

SHOWN_MESSAGES = 60  # a long conversation opens with its latest messages; older ones on request
TITLE_CHARS = 48

EMPTY_CHAT = "Ask anything.\nAnswers stream in here, with their speed underneath."
EMPTY_DEMO = ("This is the demo model: a 5-million-parameter network trained only on Jane Austen's "
              "novels, so it answers in Austen-flavoured pastiche, not facts. It is here to show how "
              "sparse inference works with no download.\n\nFor a real assistant, get a chat model "
              "on the Models page.")
def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def versions_of(msg) -> list[dict]:
    """Every version of an answer, oldest first: the earlier ones kept in its stats, and itself
    at the place it was paged to."""
    stats = dict(msg.stats or {})
    earlier = [v for v in stats.pop("versions", None) or [] if isinstance(v, dict)]
    index = stats.pop("version_index", len(earlier))
    index = max(0, min(len(earlier), index if isinstance(index, int) else len(earlier)))
    current = {"content": msg.content, "status": msg.status, "stats": stats}
    return earlier[:index] + [current] + earlier[index:]


class ChatPage(QWidget):
    conversations_changed = Signal(int)  # a conversation was created, renamed or touched
    busy_changed = Signal(bool)
    export_requested = Signal(int, str)  # conversation id, "md" or "json"
    sidebar_toggle_requested = Signal()
    models_page_requested = Signal()

    def __init__(self, storage: Storage, settings: Settings, client: EngineClient,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatPage")
        self.storage, self.settings, self.client = storage, settings, client
        self.conversation: Conversation | None = None
        self.session = ChatSession(storage, client, self)
        self._editing_id: int | None = None
        self._edit_original: str | None = None  # the edited message's text as it was
        self._draft_before_edit = ""            # what the box held when the edit began

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        self.banner = Banner(self)
        layout.addWidget(self._build_header())
        self.view = ChatView(self)
        self.view.set_empty_text(EMPTY_CHAT)
        self.view.regenerate_requested.connect(self.regenerate)
        self.view.version_requested.connect(self.show_version)
        self.view.edit_requested.connect(self.begin_edit)
        self.view.delete_requested.connect(self.ask_delete)
        self.view.continue_requested.connect(self.continue_answer)
        self.view.show_earlier_requested.connect(self._show_all)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.banner)
        self.readout = LiveReadout(self)
        layout.addWidget(self.readout)
        self.input = InputBar(self)
        self.input.edit.setAccessibleName("Message")
        self.input.button.setAccessibleName("Send or stop")
        self.input.send_requested.connect(self.send)
        self.input.stop_requested.connect(self.stop)
        layout.addWidget(self.input)
        self.drafts = Drafts(self.input.edit)
        stop = QShortcut(QKeySequence(Qt.Key.Key_Escape), self, activated=self.stop)
        stop.setWhatsThis("Stop the answer being written")

        s = self.session
        s.answer_started.connect(self._on_answer_started)
        s.text_changed.connect(self._on_answer_text)
        s.live.connect(self._on_live_stats)
        s.ended.connect(self._on_answer_ended)
        s.dropped.connect(self._on_answer_dropped)
        s.failed.connect(self._on_failed)
        s.busy_changed.connect(self._set_busy)
        s.save_problem.connect(self._show_save_problem)
        client.context_report.connect(self._on_context_report)
        client.loaded.connect(self._on_model_loaded)
        client.load_failed.connect(self._on_model_event)
        client.loading.connect(self._on_model_event)
        self._sync_ready()
        self._set_readout_idle()

    def _build_header(self) -> QWidget:
        header = QFrame(self)
        header.setObjectName("chatHeader")
        row = QHBoxLayout(header)
        row.setContentsMargins(8, 8, 12, 8)
        self.sidebar_button = QToolButton(header)
        self.sidebar_button.setObjectName("sidebarToggle")
        self.sidebar_button.setText("☰")
        self.sidebar_button.setAccessibleName("Conversation list")
        self.sidebar_button.setToolTip("Show or hide the conversation list (Ctrl+Shift+L)")
        self.sidebar_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.sidebar_button.clicked.connect(self.sidebar_toggle_requested)
        row.addWidget(self.sidebar_button)
        self.title_label = ElidedLabel("New chat", header)
        self.title_label.setObjectName("chatTitle")
        row.addWidget(self.title_label, 1)
        self.context = ContextReadout(header, self, self.settings, self.client, self.banner, self.new_conversation)
        self.context_label, self.context_bar = self.context.label, self.context.bar
        row.addWidget(self.context_label)
        row.addWidget(self.context_bar)
        self.settings_button = QPushButton("Chat settings", header)
        self.settings_button.setObjectName("chatSettingsButton")
        self.settings_button.setToolTip("System prompt and sampling for this conversation")
        self.settings_button.clicked.connect(self.open_conversation_settings)
        row.addWidget(self.settings_button)
        self.more_button = QToolButton(header)
        self.more_button.setObjectName("chatMore")
        self.more_button.setText("⋯")
        self.more_button.setAccessibleName("More")
        self.more_button.setToolTip("Export this conversation")
        self.more_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        more = QMenu(self.more_button)
        self.export_md = more.addAction("Export as Markdown…", lambda: self._export("md"))
        self.export_json = more.addAction("Export as JSON…", lambda: self._export("json"))
        self.more_button.setMenu(more)
        row.addWidget(self.more_button)
        return header

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self.context.fit_width()

    def _export(self, kind: str) -> None:
        if self.conversation is not None:
            self.export_requested.emit(self.conversation.id, kind)

    def set_sidebar_hidden(self, hidden: bool) -> None:
        self.sidebar_button.setToolTip(("Show" if hidden else "Hide") +
                                       " the conversation list (Ctrl+Shift+L)")

    def set_dark(self, dark: bool) -> None:
        """Code colours follow the theme (syntax highlighting has a light and a dark scheme)."""
        from .markdown_view import set_code_theme

        set_code_theme(dark)

    @property
    def busy(self) -> bool:
        """An answer of this page is in progress (until its last signal has been handled)."""
        return self.session.busy

    # -- conversations -------------------------------------------------------------------
    def open_conversation(self, conversation_id: int | None) -> None:
        if self.conversation is not None and conversation_id == self.conversation.id:
            return
        self.stop()
        self._finish_edit()  # an edit left by leaving is dropped; the draft it set aside is kept
        self.banner.hide()
        self.conversation = self.storage.conversation(conversation_id) if conversation_id else None
        self.drafts.switch(self.conversation.id if self.conversation else None)
        self._set_readout_idle()  # the figures of the previous chat do not belong to this one
        self._reload_view()
        self.settings["ui.last_conversation"] = self.conversation.id if self.conversation else None

    def new_conversation(self) -> None:
        self.stop()
        self._finish_edit()
        self.banner.hide()
        self.conversation = None
        self.drafts.switch(None)
        self._set_readout_idle()
        self._reload_view()
        self.input.edit.setFocus()

    def forget(self, conversation_id: int) -> None:
        """The conversation was deleted elsewhere (the sidebar)."""
        if self.conversation and self.conversation.id == conversation_id:
            self.stop()
            self.session.abandon()
            self.conversation = None
            self.drafts.forget(conversation_id)
            self.drafts.switch(None)
            self._reload_view()
        else:
            self.drafts.forget(conversation_id)

    def refresh_title(self) -> None:
        if self.conversation:
            self.conversation = self.storage.conversation(self.conversation.id)
        title = self.conversation.title if self.conversation else "New chat"
        self.title_label.setText(title)
        if self.isWindow() is False and self.window() is not None:
            self.window().setWindowTitle(f"{title} — Thermocline")

    def _reload_view(self, show_all: bool = False) -> None:
        self.view.clear()
        self.view.set_empty_text(EMPTY_DEMO if self._is_demo() else EMPTY_CHAT)
        hidden = 0
        if self.conversation is not None:
            messages = [m for m in self.storage.messages(self.conversation.id) if m.role != "system"]
            if not show_all and len(messages) > SHOWN_MESSAGES:
                hidden = len(messages) - SHOWN_MESSAGES
                messages = messages[hidden:]
            for m in messages:
                self.view.add_message(m.id, m.role, m.content, m.status, m.stats, m.created_at, self._writer_of(m),
                                      m.tool_calls, m.tool_call_id)
        self.view.set_hidden_count(hidden)
        self.refresh_title()
        self.view.update_actions(self.client.busy)
        self.view.scroll_to_bottom()
        self.context.opened(empty=self.conversation is None)
        self._recount()

    def _show_all(self) -> None:
        bar = self.view.verticalScrollBar()
        self._reload_view(show_all=True)
        bar.setValue(0)  # the user asked for the older messages: start at the top

    def _ensure_conversation(self, first_text: str) -> Conversation:
        if self.conversation is None:
            self.conversation = self.storage.create_conversation(
                title_from(first_text), system_prompt=self.settings["chat.system_prompt"],
                sampling=self.settings.sampling_defaults(), model=self.settings["model.active"])
            self.settings["ui.last_conversation"] = self.conversation.id
            self.drafts.adopt(self.conversation.id)
            self.refresh_title()
        return self.conversation

    # -- sending -------------------------------------------------------------------------
    def send(self, text: str) -> None:
        if self.client.busy:
            return
        if self.client.model_info and self.drafts.needs_counting(text):
            # A long message (a paste): count its tokens first; _on_context_report sends it,
            # or says it cannot fit and gives it back to the prompt box.
            self.drafts.hold(text)
            self.readout.setText("Measuring the message…")
            self.client.count_tokens(DRAFT_TAG, self._draft_messages(text), self._context_options())
            return
        self.drafts.pending = None
        try:
            self._send(text)
        except WRITE_ERRORS as exc:  # nothing was sent: the text goes back to the box
            log.warning("could not save the message: %s", exc)
            self.drafts.give_back(text)
            self.session.save_failed(exc, "Nothing was sent; your message is back in the box. Free some disk "
                                          "space, then send it again.")

    def _send(self, text: str) -> None:
        conv = self._ensure_conversation(text)
        if self._editing_id is not None:
            self.storage.delete_messages_from(conv.id, self._editing_id)
            self._reload_view()
        self.banner.hide()
        if conv.title == "New chat" and not self.storage.messages(conv.id):
            self.storage.rename_conversation(conv.id, title_from(text))
            self.refresh_title()
        msg = self.storage.add_message(conv.id, "user", text)
        self._finish_edit()  # sent (a failed save above leaves the edit and its text to send again)
        self.view.add_message(msg.id, "user", text, created_at=msg.created_at)
        self.conversations_changed.emit(conv.id)
        self._start_answer()

    def regenerate(self, message_id: int) -> None:
        """Replace the last answer with a fresh one (or answer a last, unanswered prompt)."""
        if self.client.busy or self.conversation is None or not self.client.model_info:
            return
        last = self.view.last()
        if last is None or last.message_id != message_id:
            return
        try:
            earlier: list[dict] = []
            if last.role == "assistant":
                old = self.storage.message(message_id)
                if old is not None and old.content:
                    earlier = versions_of(old)  # kept: the new answer can page back to them
                self.storage.delete_messages_from(self.conversation.id, message_id)
                self._reload_view()
            self.banner.hide()
            self._start_answer(earlier)
        except WRITE_ERRORS as exc:
            self.session.save_failed(exc, "Nothing was changed. Free some disk space, then try again.")

    def show_version(self, message_id: int, index: int) -> None:
        """Page a regenerated answer to its version `index` (that one is what the chat continues from)."""
        if self.client.busy:
            return
        msg = self.storage.message(message_id)
        if msg is None:
            return
        versions = versions_of(msg)
        if not 0 <= index < len(versions):
            return
        chosen = versions.pop(index)
        stats = dict(chosen.get("stats") or {})
        stats["versions"], stats["version_index"] = versions, index
        self.storage.update_message(message_id, content=chosen["content"], status=chosen.get("status", COMPLETE),
                                    stats=stats)
        w = next((m for m in self.view.messages() if m.message_id == message_id), None)
        if w is not None:
            w.set_text(chosen["content"])
            w.set_status(chosen.get("status", COMPLETE))
            w.set_stats(stats)
        self.readout.answered(chosen.get("stats"), self.client.model_info)  # the figures of the version shown
        self._recount()

    def ask_delete(self, message_id: int) -> QMessageBox | None:
        """Delete a message and every one after it (as sending an edit does), once confirmed."""
        if self.client.busy or self.conversation is None:
            return None
        ids = [m.id for m in self.storage.messages(self.conversation.id) if m.role != "system"]
        if message_id not in ids:
            return None
        after = len(ids) - ids.index(message_id) - 1
        what = "this message" if not after else f"this message and the {fmt.count(after, 'message')} after it"
        box = QMessageBox(QMessageBox.Icon.Question, "Delete messages", f"Delete {what}?",
                          QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, self.window())
        box.setObjectName("deleteMessagesDialog")
        box.setInformativeText("The conversation goes on from the message before it. This cannot be undone.")
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        box.button(QMessageBox.StandardButton.Yes).setText("Delete")
        box.accepted.connect(lambda: self.delete_from(message_id))
        box.open()
        self.delete_dialog = box
        return box

    def delete_from(self, message_id: int) -> None:
        if self.client.busy or self.conversation is None:
            return
        try:
            self.storage.delete_messages_from(self.conversation.id, message_id)
        except WRITE_ERRORS as exc:
            self.session.save_failed(exc, "Nothing was deleted. Free some disk space, then try again.")
            return
        if self._editing_id is not None and self.storage.message(self._editing_id) is None:
            self._cancel_edit()  # the message being edited went with them
        self.banner.hide()
        self._reload_view()
        self._set_readout_idle()  # the figures shown were of an answer now gone, or of an earlier one
        self.conversations_changed.emit(self.conversation.id)

    def continue_answer(self, message_id: int) -> None:
        """Write on where the last answer stopped (stopped by the user, or at the longest answer)."""
        if self.client.busy or self.conversation is None or not self.client.model_info:
            return
        last = self.view.last()
        msg = self.storage.message(message_id)
        if last is None or last.message_id != message_id or msg is None or msg.role != "assistant":
            return
        if (self.client.model_info or {}).get("remote"):
            show_error(self.window(), "Cannot continue", "A remote model is given whole messages, so it cannot "
                       "write on inside an answer.", "Regenerate the answer, or ask it to go on.")
            return
        conv = self.conversation
        before = self._chat_messages()[:-1]  # the answer itself becomes the prompt's end
        self.banner.hide()
        try:
            self.session.resume(conv.id, msg, self._request(before),
                                model=(self.client.model_info or {}).get("model") or self.settings["model.active"])
        except WRITE_ERRORS as exc:
            self.session.save_failed(exc, "Nothing was changed. Free some disk space, then try again.")
            return
        self.readout.setText("● Reading the prompt…  (Esc stops)")

    def begin_edit(self, message_id: int) -> None:
        if self.client.busy or self.conversation is None:
            return
        msg = self.storage.message(message_id)
        if msg is None or msg.role != "user":
            return
        box = self.input.edit.toPlainText()
        if self._editing_id is not None and box != self._edit_original:
            # the edit under way holds the user's words too: it is sent or cancelled first
            self.banner.show_message("You are editing another message: send it or cancel that edit first.",
                                     "info", "Cancel edit", self._cancel_edit)
            return
        if self._editing_id is None:
            self._draft_before_edit = box  # the unsent draft comes back when the edit ends
        self._editing_id, self._edit_original = message_id, msg.content
        self.input.edit.setPlainText(msg.content)
        self.input.edit.setFocus()
        self.banner.show_message("Editing a message: sending replaces it and every message after it.",
                                 "info", "Cancel edit", self._cancel_edit)

    def _cancel_edit(self) -> None:
        self._finish_edit()
        self.banner.hide()

    def _finish_edit(self) -> None:
        """Leave edit mode with the draft the edit set aside back in the box (the edit's own text
        goes: sent, or cancelled)."""
        if self._editing_id is None:
            return
        self._editing_id = self._edit_original = None
        self.input.edit.setPlainText(self._draft_before_edit)
        self.input.edit.moveCursor(QTextCursor.MoveOperation.End)
        self._draft_before_edit = ""

    def stop(self) -> None:
        if self.input.cancel_waiting():
            self.readout.setText("Not sent: the message stays in the box.")
            return
        if self.session.stop():
            self.input.set_stopping()
            self.readout.setText("● Stopping…")

    def close_out(self) -> None:
        """The window is closing: stop, and keep the partial answer as stopped, not interrupted."""
        self.session.close_out()

    def _system_prompt(self) -> str:
        """The conversation's system prompt, unless it is the default assistant one and the model
        is a base model (it continues text; the prompt would only take room)."""
        prompt = self.conversation.system_prompt if self.conversation else self.settings["chat.system_prompt"]
        if (self.client.model_info or {}).get("base_model") and prompt.strip() == DEFAULT_SYSTEM_PROMPT:
            return ""
        return prompt

    def _draft_messages(self, text: str) -> list[dict]:
        prompt = self._system_prompt()
        return ([{"role": "system", "content": prompt}] if prompt.strip() else []) + \
            [{"role": "user", "content": text}]

    def _context_options(self) -> dict:
        return {"context_policy": self.settings["chat.context_policy"],
                "max_new_tokens": self._sampling().get("max_new_tokens") if self.conversation
                else self.settings["chat.max_new_tokens"]}

    def _chat_messages(self) -> list[dict]:
        conv = self.conversation
        msgs = []
        prompt = self._system_prompt()
        if prompt.strip():
            msgs.append({"role": "system", "content": prompt})
        for m in self.storage.messages(conv.id):
            if m.role != "system" and (m.content or m.tool_calls):
                msgs.append(m.as_chat())
        # Tool calls and results as plain turns: every chat template reads those (few take tools).
        return for_template(msgs, tool_aware=False)

    def _sampling(self) -> dict:
        params = self.settings.sampling_defaults()
        params.update({k: v for k, v in (self.conversation.sampling or {}).items() if k in params})
        return params

    def _request(self, messages: list[dict]) -> ChatRequest:
        """One answer's request: the chat's sampling values that are set, its context policy."""
        return ChatRequest(messages, {k: v for k, v in self._sampling().items() if v is not None},
                           self.settings["chat.context_policy"], self.conversation.id)

    def _start_answer(self, earlier: list[dict] | None = None) -> None:
        conv = self.conversation
        self.session.start(conv.id, self._request(self._chat_messages()), earlier,
                           model=(self.client.model_info or {}).get("model") or self.settings["model.active"])
        self.readout.setText("● Reading the prompt…  (Esc stops)")

    # -- session signals -------------------------------------------------------------------
    def _on_answer_started(self, answer) -> None:
        last = self.view.last()
        if last is not None and last.message_id == answer.id:  # continued: it streams in place
            last.set_status(STREAMING)
            return
        self.view.add_message(answer.id, "assistant", "", STREAMING, None, answer.created_at, self._model_name())

    def _on_answer_text(self, answer_id: int, text: str) -> None:
        w = self.view.last()
        if w is not None and w.message_id == answer_id:
            w.set_text(text)

    def _show_save_problem(self, exc, todo: str) -> None:
        self.save_error = show_error(self.window(), "Could not save the conversation",
                                     f"Writing to {self.storage.path} failed: {exc}", todo)

    def _on_live_stats(self, stats: AnswerStats) -> None:
        if not self.session.stopping:
            self.readout.streaming(stats)
        if stats.prompt_tokens:  # the context fills as the answer grows
            self.context.live(int(stats.prompt_tokens) + stats.new_tokens, stats.dropped_messages)

    def _on_answer_ended(self, answer_id: int, status: str, stats: AnswerStats) -> None:
        w = self.view.last()
        if w is not None and w.message_id == answer_id:
            w.set_text(self.session.answer_text)
            w.set_status(status)
            w.set_stats(stats.raw or None)
        if self.conversation is not None:
            self.conversations_changed.emit(self.conversation.id)
        self._recount()
        if status == FAILED:
            return  # _on_failed says why
        self.context.dropped = stats.dropped_messages or self.context.dropped
        self.readout.setText(self.live_text(stats, final=True))
        if stats.finish_reason == "interrupted":  # a remote stream broke off: the partial answer stays
            show_error(self.window(), "The answer was interrupted", stats.error,
                       "The partial answer is kept. Check the remote server, then regenerate.")
        if stats.finish_reason == "context_full":
            self.context.show_full()

    def _on_answer_dropped(self, conversation_id: int, stats: AnswerStats | None) -> None:
        if self.conversation is not None and self.conversation.id == conversation_id:
            self._reload_view()
        if stats is None:
            return  # it failed: _on_failed says why
        if stats.finish_reason == "context_full":
            self.context.show_full()
        else:
            self.readout.setText("Stopped before the answer began.")

    def _on_failed(self, what: str, todo: str) -> None:
        self._set_readout_idle()
        show_error(self.window(), "Could not answer", what, todo)

    def _set_busy(self, busy: bool) -> None:
        self.input.set_busy(busy)
        self.view.update_actions(busy)
        self.settings_button.setEnabled(not busy)
        self.busy_changed.emit(busy)

    # -- readouts ------------------------------------------------------------------------
    live_text = staticmethod(live_text)  # the readout's words (live_readout.py), kept here for callers

    def _set_readout_idle(self) -> None:
        self.readout.idle(self.client.model_info)

    def _is_demo(self) -> bool:
        info = self.client.model_info
        spec = info.get("model") if info else self.settings["model.active"]
        return spec == "demo"

    def _model_name(self) -> str:
        info = self.client.model_info
        return fmt.model_label(info.get("model") if info else self.settings["model.active"])

    def _writer_of(self, message) -> str:
        """The model that wrote an answer: its own record, else the one its chat began with
        (answers saved before answers kept their model), never simply the model loaded now."""
        spec = (message.stats or {}).get("model") or (self.conversation.model if self.conversation else "")
        return fmt.model_label(spec) if spec else self._model_name()

    def _recount(self) -> None:
        if self.conversation is not None and self.client.model_info:
            self.client.count_tokens(self.conversation.id, self._chat_messages(), self._context_options())

    def refresh_context(self) -> None:
        """The context policy changed: count again."""
        self._recount()

    def _on_context_report(self, tag: int, report: dict) -> None:
        if tag == DRAFT_TAG:
            self._on_draft_counted(report)
        elif self.conversation is not None and tag == self.conversation.id and not self.busy:
            self.context.counted(report)

    def _on_draft_counted(self, report: dict) -> None:
        text = self.drafts.take()
        if text is None:
            return
        ctx = report["ctx"]
        room = ctx - answer_room(ctx, self._context_options()["max_new_tokens"])
        self._set_readout_idle()
        if report["tokens"] > room:
            # It cannot fit whatever is dropped: keep it in the box, and say why.
            self.drafts.give_back(text)
            self.context.too_long(report["tokens"], ctx, self.models_page_requested.emit)
            return
        self.drafts.hold(text)  # counted: send() sends it now
        self.send(text)

    def _on_model_loaded(self, info: dict) -> None:
        self.context.model_loaded(info)
        self._set_readout_idle()
        if not self.busy:
            self._reload_view()  # the empty-chat text and model names follow the model
        self._recount()
        self._sync_ready()  # last: a message typed during the load is sent here

    def _on_model_event(self, *_args) -> None:
        self._sync_ready()

    def _sync_ready(self) -> None:
        if self.client.model_info:
            self.input.set_ready(True)
        elif self.client.loading_model:
            self.input.set_ready(False, f"Loading {fmt.model_label(self.client.loading_model)}… "
                                        "you can type meanwhile", can_wait=True)
        else:
            self.input.set_ready(False, "No model loaded: choose one on the Models page")

    # -- per-conversation settings -------------------------------------------------------
    def open_conversation_settings(self) -> None:
        conv = self.conversation
        prompt = conv.system_prompt if conv else self.settings["chat.system_prompt"]
        sampling = conv.sampling if conv else self.settings.sampling_defaults()
        dlg = ConversationSettingsDialog(conv.title if conv else "New chat", prompt, sampling,
                                         self.settings, self)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)

        def done() -> None:
            new_prompt, new_sampling = dlg.values()
            if self.conversation is not None:
                self.storage.update_conversation(self.conversation.id, system_prompt=new_prompt,
                                                 sampling=new_sampling)
                self.conversation = self.storage.conversation(self.conversation.id)
                self._recount()
            elif not dlg.save_defaults.isChecked():
                # Settings for a chat not yet started: create it now so they are kept.
                self.conversation = self.storage.create_conversation(
                    "New chat", system_prompt=new_prompt, sampling=new_sampling,
                    model=self.settings["model.active"])
                self.refresh_title()
                self.conversations_changed.emit(self.conversation.id)

        dlg.accepted.connect(done)
        dlg.open()
